"""In-process recovery inside the training frameworks people train with.

A framework's training loop cannot be put inside :meth:`elasticft.inprocess.worker.InProcess.run`
by its users; its entry point can. Each module here wraps one framework's entry point
(:mod:`elasticft.integrations.lightning`: strategies for ``lightning.Trainer``;
:mod:`elasticft.integrations.hf`: a wrapper of ``transformers.Trainer.train``;
:mod:`elasticft.integrations.torchtitan`: an override of torchtitan's checkpoint manager that
wraps its ``Trainer.train``) around the shared mechanism of :mod:`elasticft.integrations.fit`.
The frameworks are optional extras (``elasticft[lightning]``, ``elasticft[hf]``,
``elasticft[torchtitan]``).
"""
