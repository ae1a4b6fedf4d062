"""The conformance matrix of in-process recovery: every training pattern at every fault point,
each cell exact, refused, or a finding.

A cell is one pattern (a plain DDP loop's flags in ``bench/conformance_loop.py``, alone and all
together; a Lightning or HF Trainer example's options) at one fault point (a SIGKILL of rank 1
where the script puts it), run under ``elasticft-run --standalone --nproc-per-node N`` with gloo,
against an uninterrupted run of the same pattern and ranks (made once per pattern and ranks).
Its result is one of:

* ``exact``: recovered in process (or, for a second failure during or right after that
  recovery, by the restart it falls back to), and every rank's loss and parameters (a hash
  of their bytes) after every step (plain loops), or the final parameters and the last step
  (frameworks), are the uninterrupted run's, bit for bit;
* ``refused: <line>``: the job said in one line that it does not recover this pattern in
  process, went on in the restart mode and ended with the uninterrupted run's result;
* ``DIFFERENT at step N (rank R)`` / ``DIFFERENT: ...``: a finding;
* ``failed: <why>``: the job failed, hung, or recovered other than in process or by a refusal
  (a restart after an in-process recovery that nothing had cut short, say): a finding.

Each row also says the recovery the event log shows (``in process``, ``restart``, or both in
their order) and kill → the job's first step after it: from the SIGKILL (the plain loop writes
its time just before sending it; the framework examples kill right after a step, so their kill
is the killed rank's last step record) to the first step record, on any rank, after the agent
started the recovery (``worker_replaced`` in process, ``workers_started`` of a restart), as
bench/recovery.py measures it from its loss log. The cells no CPU can run (CUDA's RNG, NCCL)
are listed, with the command that runs them on a GPU.

    .venv/bin/python bench/conformance.py              # the whole product: 50 min on 2 busy cores
    .venv/bin/python bench/conformance.py --quick      # 3 runs, for a test
    .venv/bin/python bench/conformance.py --only dropout,hf --markdown
    python bench/conformance.py --device cuda --only plain   # CUDA's RNG: gloo, ranks on 1 GPU
    python bench/conformance.py --device cuda --backend nccl --only plain   # a GPU per rank

``--device cuda`` runs the plain loops' model, batches, dropout and augmentation on CUDA (so
from CUDA's RNG; every rank on one GPU where there is one, over gloo); ``--backend nccl`` needs
a GPU per rank. The framework examples run on CPU only.

It exits 1 when a cell is neither exact nor refused; run directories are kept then (their path
is printed), and removed otherwise unless ``--keep``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from jobenv import clean_job_env  # noqa: E402  (bench/, beside this script)

from elasticft.events import read_events  # noqa: E402
from elasticft.steps import read_steps  # noqa: E402

BIN = Path(sys.executable).parent
LOOP = ROOT / "bench" / "conformance_loop.py"
EXAMPLES = ROOT / "examples"
STEPS = 16
"""Steps of a plain-loop run."""
CRASH_AT = 7
"""The plain loop's fault step."""
RUN_LIMIT_S = 300
"""A run still going after this long is a hang (the longest, a Lightning run, takes ~50 s)."""


@dataclasses.dataclass(frozen=True)
class Pattern:
    """One row group of the matrix: a script with its options, at some fault points."""

    name: str
    framework: str
    """``plain`` (bench/conformance_loop.py), ``lightning`` or ``hf`` (the examples)."""
    args: tuple[str, ...]
    """The script's options; ``{run}`` stands for the run's own directory."""
    faults: tuple[tuple[str, tuple[str, ...]], ...]
    """(fault point, the script's options that put the SIGKILL there)."""
    ranks: int = 2
    before: tuple[str, ...] | None = None
    """The options of an uninterrupted launch of the same script run first in each run's
    directory (``{run}`` is that run's), whose checkpoints this one resumes from."""


def plain_faults() -> tuple[tuple[str, tuple[str, ...]], ...]:
    return tuple((mode, ("--fault-rank", "1", "--crash-at-step", str(CRASH_AT), "--crash-mode",
                         mode))
                 for mode in ("after-save", "right-after-save", "before-save", "mid-step",
                              "in-optimizer-step", "twice"))


def at_step(*steps: int | tuple[int, str]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The framework examples' fault: a SIGKILL of rank 1 at the end of step N (after its
    callbacks, before its snapshot); a step given as (N, note) has the note in its label."""
    faults = []
    for step in steps:
        n, note = step if isinstance(step, tuple) else (step, "")
        faults.append((f"end of step {n}{note}", ("--fault-rank", "1", "--crash-at-step",
                                                  str(n))))
    return tuple(faults)


ALL_PLAIN = ("--zero-grad", "after", "--accum", "2", "--clip", "--warmup", "--dropout",
             "--augment", "--loader", "--loader-workers", "2", "--worker-augment", "--autocast",
             "--ema")
LIGHTNING_CHECKPOINTED = ("--epochs", "4", "--checkpoint-every", "5", "--save-last",
                          "--dropout", "0.25", "--checkpoint-dir", "{run}/own")
LIGHTNING_CALLBACKS = ("--epochs", "6", "--checkpoint-every", "2", "--save-last", "--dropout",
                       "0.25", "--checkpoint-dir", "{run}/own", "--early-stopping",
                       "--lr-monitor", "--log-dir", "{run}/csv", "--accumulate", "2")


def in_checkpoint_write(step: int, note: str = "") -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The Lightning example's fault half-way through its write of step N's checkpoint, on
    rank 0 (the rank that writes it)."""
    return ((f"in the write of step {step}'s{note} checkpoint (rank 0)",
             ("--fault-rank", "0", "--crash-at-step", str(step), "--crash-in-checkpoint-write")),)


PATTERNS: tuple[Pattern, ...] = (
    Pattern("default", "plain", (), plain_faults()),
    Pattern("default", "plain", (), plain_faults(), ranks=3),
    Pattern("default", "plain", (), plain_faults(), ranks=4),
    Pattern("zero-grad-after", "plain", ("--zero-grad", "after"), plain_faults()),
    Pattern("accum-2", "plain", ("--accum", "2"), plain_faults()),
    Pattern("clip", "plain", ("--clip",), plain_faults()),
    Pattern("warmup", "plain", ("--warmup",), plain_faults()),
    Pattern("dropout", "plain", ("--dropout",), plain_faults()),
    Pattern("augment", "plain", ("--augment",), plain_faults()),
    Pattern("loader", "plain", ("--loader",), plain_faults()),
    Pattern("loader-workers-2", "plain", ("--loader", "--loader-workers", "2"), plain_faults()),
    Pattern("loader-workers-2+augment", "plain",
            ("--loader", "--loader-workers", "2", "--worker-augment", "--dropout"),
            plain_faults()),
    Pattern("loader-own-generator+augment", "plain",
            ("--loader", "--loader-generator", "--loader-workers", "2", "--worker-augment"),
            plain_faults()),
    Pattern("autocast-bf16", "plain", ("--autocast",), plain_faults()),
    Pattern("ema", "plain", ("--ema",), plain_faults()),
    Pattern("compile", "plain", ("--compile", "--dropout"), plain_faults()),
    Pattern("all", "plain", ALL_PLAIN, plain_faults()),
    Pattern("ddp", "lightning", (), at_step((1, " (before its snapshot)"), 4)),
    Pattern("ddp+dropout+checkpoint", "lightning", LIGHTNING_CHECKPOINTED,
            at_step(7, (10, " (a ModelCheckpoint step)"))),
    Pattern("ddp+dropout+checkpoint+fit(ckpt_path=last)", "lightning",
            (*LIGHTNING_CHECKPOINTED, "--resume-last"),
            at_step(7, (10, " (a ModelCheckpoint step)")) + in_checkpoint_write(10)),
    Pattern("relaunch+fit(ckpt_path=last)", "lightning",
            ("--epochs", "4", "--checkpoint-every", "5", "--save-last", "--dropout", "0.25",
             "--checkpoint-dir", "{run}/own", "--resume-last"),
            at_step((11, " (the relaunch's first)"),
                    (12, " (mid-epoch, its iterator from the start)"),
                    (13, " (the next epoch's first)")),
            before=("--epochs", "2", "--checkpoint-every", "5", "--save-last", "--dropout",
                    "0.25", "--checkpoint-dir", "{run}/own")),
    Pattern("callbacks+accumulate-2", "lightning", LIGHTNING_CALLBACKS,
            at_step(5, (4, " (a ModelCheckpoint step)")) + in_checkpoint_write(4)),
    Pattern("ddp+epoch-end-checkpoint", "lightning",
            ("--epochs", "4", "--checkpoint-every", "0", "--save-last", "--dropout", "0.25",
             "--checkpoint-dir", "{run}/own"),
            at_step((6, " (an epoch's last)")) + in_checkpoint_write(6, " (epoch-end)")),
    Pattern("ddp (pytorch_lightning)", "lightning", ("--pytorch-lightning",), at_step(4)),
    Pattern("fsdp2", "lightning", ("--model-parallel",), at_step(4)),
    Pattern("tensor-parallel", "lightning", ("--model-parallel", "--tensor-parallel"),
            at_step(4)),
    Pattern("trainer", "hf", (), at_step((1, " (before its snapshot)"), 4)),
    Pattern("save-steps+eval", "hf", ("--output-dir", "{run}/own", "--save-steps", "3",
                                      "--eval-steps", "3"),
            (*at_step((3, " (a save step)")),
             ("in the write of step 3's checkpoint (rank 0)",
              ("--fault-rank", "0", "--crash-at-step", "3", "--crash-in-checkpoint-write")))),
    Pattern("grad-accum+warmup", "hf", ("--grad-accum", "2", "--warmup-steps", "3"),
            at_step(3)),
    Pattern("gpt2-dropout", "hf", ("--model", "gpt2"), at_step(4)),
    Pattern("count-steps", "hf", ("--count-steps",), at_step(4)),
    Pattern("shuffle-from-torch-rng", "hf", ("--shuffle-from-torch-rng",), at_step(4)),
)
"""The matrix: each plain pattern alone and all together, the default with 3 and 4 ranks too, and
the framework examples' options (Lightning's ModelCheckpoint with dropout; EarlyStopping,
LearningRateMonitor and gradient accumulation with it, a fault in its checkpoint write too; the
standalone pytorch_lightning package; FSDP2 and tensor parallel under its model-parallel
strategy; the Trainer's own saves, accumulation with a
warm-up, a GPT-2 with dropout, a callback with state, a sampler shuffled from torch's RNG)."""

QUICK = (Pattern("default", "plain", (), plain_faults()[0:3:2]),)
"""--quick: the default loop after a save and before one (an uninterrupted run and 2 cells)."""

NOT_ON_CPU = (
    ("each, on CUDA (CUDA's RNG)", "plain", "each",
     "needs a GPU: bash bench/gpu_check.sh --parts conformance (gloo, both ranks on one GPU)"),
    ("each, under NCCL", "plain", "each",
     "needs 2 GPUs: bench/conformance.py --device cuda --backend nccl --only plain"),
    ("each, on CUDA", "lightning, hf", "each",
     "not run on a GPU: the framework examples train on CPU only"),
)
"""(pattern, framework, fault point, why) of the cells no CPU runs."""


@dataclasses.dataclass
class Run:
    """One job: how it ended and what it left."""

    run_dir: Path
    returncode: int | None
    """None: still running at :data:`RUN_LIMIT_S`, killed."""
    text: str
    events: list[dict]
    losses: dict[tuple[int, int], str]
    """(rank, step) -> the loss's repr, the last try of a step redone (plain loops)."""
    params: dict | None
    """The final parameters rank 0 wrote (framework examples)."""
    kill_time: float | None


def command(pattern: Pattern, run_dir: Path, extra: tuple[str, ...],
            placement: tuple[str, ...] = ()) -> list[str]:
    """The job's command line; ``placement``: the plain loop's --device and --backend."""
    args = [a.replace("{run}", str(run_dir)) for a in (*pattern.args, *extra)]
    launch = [str(BIN / "elasticft-run"), "--standalone", "--nproc-per-node", str(pattern.ranks),
              "--max-restarts", "3", "--run-dir", str(run_dir), "--ckpt-persist-every", "0",
              "--monitor-interval", "0.1"]
    if pattern.framework == "plain":
        return [*launch, str(LOOP), "--steps", str(STEPS), "--loss-log",
                str(run_dir / "loss.log"), "--pid-log", str(run_dir / "pid.log"), "--kill-log",
                str(run_dir / "kill.log"), *placement, *args]
    script = {"lightning": "train_lightning_inprocess.py", "hf": "train_hf_inprocess.py"}
    return [*launch, str(EXAMPLES / script[pattern.framework]), "--params-out",
            str(run_dir / "params.pt"), "--pid-log", str(run_dir / "pid.log"), *args]


def run_job(pattern: Pattern, run_dir: Path, extra: tuple[str, ...],
            placement: tuple[str, ...] = ()) -> Run:
    run_dir.mkdir(parents=True)
    if pattern.before is not None:
        first = dataclasses.replace(
            pattern, args=tuple(a.replace("{run}", str(run_dir)) for a in pattern.before))
        returncode = launch(command(first, run_dir / "before", (), placement),
                            run_dir / "before")
        if returncode != 0:
            run = read_run(run_dir / "before", returncode)
            return dataclasses.replace(run, text="the launch before this one:\n" + run.text)
    return read_run(run_dir, launch(command(pattern, run_dir, extra, placement), run_dir))


def launch(cmd: list[str], run_dir: Path) -> int | None:
    """Runs one job to its end; None: still running at :data:`RUN_LIMIT_S`, killed."""
    run_dir.mkdir(parents=True, exist_ok=True)
    with (run_dir / "launcher.out").open("wb") as log:
        proc = subprocess.Popen(cmd, env=clean_job_env(), cwd=run_dir, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            return proc.wait(timeout=RUN_LIMIT_S)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None


def read_run(run_dir: Path, returncode: int | None) -> Run:
    """What a job left in ``run_dir``."""
    losses: dict[tuple[int, int], str] = {}
    if (run_dir / "loss.log").exists():
        for line in (run_dir / "loss.log").read_text().splitlines():
            rank, step, loss = line.split()
            losses[int(rank), int(step)] = loss
    params = None
    if (run_dir / "params.pt").exists():
        import torch

        params = torch.load(run_dir / "params.pt")
    kill = run_dir / "kill.log"
    out = run_dir / "launcher.out"
    return Run(run_dir, returncode, out.read_text(errors="replace"), read_events(run_dir),
               losses, params, float(kill.read_text()) if kill.exists() else None)


def recovery_kinds(events: list[dict]) -> str:
    """The recoveries the agent decided, in their order: ``in process`` (``not completed``
    when no ``recover_in_process`` event followed before the next decision), ``restart``."""
    seen: list[str] = []
    for event in events:
        if event["kind"] == "decision" and event.get("action") == "recover_in_process":
            seen.append("in process (not completed)")
        elif event["kind"] == "decision" and str(event.get("action", "")).startswith("restart"):
            seen.append("restart")
        elif event["kind"] == "recover_in_process" and seen:
            seen[-1] = "in process"
    return ", then ".join(seen) or "none"


def kill_to_first_step(run: Run) -> float | None:
    """Seconds from the SIGKILL to the first step record, on any rank, after the agent started
    the recovery; None when there was no failure or no step after it."""
    failure = next((e for e in run.events if e["kind"] == "failure"), None)
    if failure is None:
        return None
    started = next((e["time"] for e in run.events if e["time"] >= failure["time"] and (
        e["kind"] == "worker_replaced"
        or (e["kind"] == "workers_started" and e.get("attempt", 0) > 0))), None)
    steps = read_steps(run.run_dir)
    kill = run.kill_time
    if kill is None:  # the framework examples kill right after a step of the killed rank
        kill = max((r.time for r in steps.get(failure["rank"], []) if r.time <= failure["time"]),
                   default=failure["time"])
    after = [r.time for records in steps.values() for r in records
             if started is not None and r.time > started]
    return min(after) - kill if after else None


RAISED = re.compile(r"^([\w.]*[A-Z]\w*(?:Error|Exception|Diverged|Interrupted)): (.*)")
"""The last line of a traceback: the exception that ended a process."""
ERROR = re.compile(r"\b([A-Z]\w*(?:Error|Exception|Diverged|Interrupted)): (.*)")
REFUSAL = re.compile(r"refus|not recovered in process|restart mode", re.IGNORECASE)


def worker_lines(run: Run) -> list[str]:
    """The workers' log lines, attempt by attempt, without torch's ``[rankN]:`` prefixes."""
    lines = []
    for path in sorted((run.run_dir / "logs").rglob("*.log")):
        for line in path.read_text(errors="replace").splitlines():
            lines.append(re.sub(r"^(\[rank\d+\]: )+", "", line).strip())
    return lines


def first_error(run: Run) -> str:
    """The first exception that ended a worker, else the first error a log names, else the
    launcher's last line."""
    lines = [*worker_lines(run), *run.text.splitlines()]
    for pattern in (RAISED, ERROR):
        for line in lines:
            if match := pattern.search(line):
                return f"{match[1].rsplit('.', 1)[-1]}: {match[2]}"[:220]
    tail = [line for line in run.text.splitlines() if line.strip()]
    return tail[-1][:220] if tail else "no output"


def difference(run: Run, reference: Run, framework: str) -> str | None:
    """None when the run's results are the reference's bit for bit, else what differs."""
    if framework == "plain":
        differing = sorted((step, rank) for (rank, step), loss in reference.losses.items()
                           if run.losses.get((rank, step)) != loss)
        if differing:
            step, rank = differing[0]
            return f"DIFFERENT at step {step} (rank {rank}; {len(differing)} (rank, step) differ)"
        return None
    import torch

    if run.params is None or reference.params is None:
        return "failed: no final parameters written"
    keys = [k for k in reference.params if k not in run.params
            or not torch.equal(run.params[k], reference.params[k])]
    if keys:
        return f"DIFFERENT: final parameters {', '.join(keys)[:120]}"
    if last_step(run) != last_step(reference):
        return f"DIFFERENT: ended at step {last_step(run)}, not {last_step(reference)}"
    return None


def last_step(run: Run) -> int | None:
    """The highest step any rank recorded (the optimizer's own count for the examples)."""
    return max((r.step for records in read_steps(run.run_dir).values() for r in records),
               default=None)


def judge(run: Run, reference: Run, framework: str) -> str:
    """The cell's result (see the module's docstring)."""
    if run.returncode is None:
        return f"failed: hung (still running after {RUN_LIMIT_S} s)"
    if run.returncode != 0:
        return f"failed: exit {run.returncode}: {first_error(run)}"
    kinds = recovery_kinds(run.events)
    if kinds == "none":
        return "failed: no recovery in the event log (no fault?)"
    differs = difference(run, reference, framework)
    if kinds == "in process":
        return differs or "exact"
    if kinds == "restart":
        refusal = next((line for line in worker_lines(run) if REFUSAL.search(line)), None)
        if refusal is None:
            return f"failed: restarted without a refusal line: {first_error(run)}"
        return differs or f"refused: {refusal[:200]}"
    if kinds.startswith("in process") and kinds.endswith("then restart") and any(
            e["kind"] == "decision" and e.get("in_process_failed_at") is not None
            for e in run.events):
        return differs or "exact"  # a failure during or right after an in-process recovery
    ended = f"; then {differs}" if differs else "; ended exact"
    return f"failed: {kinds}: {first_error(run)[:150]}{ended}"


def reference_problem(run: Run, framework: str) -> str | None:
    if run.returncode != 0:
        return f"failed: the uninterrupted run: exit {run.returncode}: {first_error(run)}"
    if framework == "plain" and len(run.losses) == 0:
        return "failed: the uninterrupted run logged no loss"
    if framework != "plain" and run.params is None:
        return "failed: the uninterrupted run wrote no parameters"
    return None


@dataclasses.dataclass
class Row:
    pattern: str
    framework: str
    ranks: str
    fault: str
    result: str
    recovery: str
    first_step: str

    @property
    def ok(self) -> bool:
        return self.result == "exact" or self.result.startswith(("refused", "not run"))


HEADERS = ("pattern", "framework", "ranks", "fault point", "result", "recovery",
           "kill → first step")
WIDTHS = (22, 9, 5, 52, 0, 0, 0)


def text_row(row: Row) -> str:
    cells = dataclasses.astuple(row)
    head = " ".join(f"{c:{w}}" for c, w in zip(cells[:4], WIDTHS[:4], strict=True))
    return f"{head} {row.first_step:>8} {row.recovery:24} {row.result}"


def text_header() -> str:
    head = " ".join(f"{c:{w}}" for c, w in zip(HEADERS[:4], WIDTHS[:4], strict=True))
    return f"{head} {'kill→step':>8} {'recovery':24} result"


def markdown(rows: list[Row]) -> str:
    lines = ["| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    for row in rows:
        cells = [c.replace("|", "\\|") for c in dataclasses.astuple(row)]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def chosen(only: str | None, quick: bool) -> tuple[Pattern, ...]:
    if quick:
        return QUICK
    if not only:
        return PATTERNS
    names = set(only.split(","))
    picked = tuple(p for p in PATTERNS if p.name in names or p.framework in names)
    unknown = names - {p.name for p in picked} - {p.framework for p in picked}
    if unknown:
        known = sorted({p.name for p in PATTERNS} | {p.framework for p in PATTERNS})
        raise SystemExit(f"conformance: no pattern {', '.join(sorted(unknown))}; "
                         f"known: {', '.join(known)}")
    return picked


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true",
                        help="the default plain loop at 2 fault points only (for a test)")
    parser.add_argument("--only", help="comma-separated patterns or frameworks (plain, "
                        "lightning, hf)")
    parser.add_argument("--markdown", action="store_true",
                        help="print the table as Markdown at the end (rows go to stderr)")
    parser.add_argument("--keep", action="store_true", help="keep the run directories")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the plain loops train (cuda: CUDA's RNG)")
    parser.add_argument("--backend", choices=("gloo", "nccl"), default="gloo",
                        help="the plain loops' process group (nccl: a GPU per rank)")
    args = parser.parse_args(argv)
    patterns = chosen(args.only, args.quick)
    placement: tuple[str, ...] = ()
    if (args.device, args.backend) != ("cpu", "gloo"):
        if args.backend == "nccl" and args.device != "cuda":
            parser.error("--backend nccl needs --device cuda")
        if any(p.framework != "plain" for p in patterns):
            parser.error(f"--device {args.device} --backend {args.backend}: the framework "
                         "examples train on CPU with gloo only; add --only plain")
        placement = ("--device", args.device, "--backend", args.backend)
    progress = sys.stderr if args.markdown else sys.stdout

    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="elasticft-conformance-"))
    print(f"# conformance {time.strftime('%Y-%m-%d %H:%M %Z')}  {platform.node()}  "
          f"{os.cpu_count()} cores  torch {torch_version()}  {args.backend} on {args.device}  "
          f"{STEPS} steps (plain loops), "
          f"SIGKILL of rank 1", file=progress, flush=True)
    print(text_header(), file=progress, flush=True)
    rows: list[Row] = []
    for index, pattern in enumerate(patterns):
        group = work / f"{index:02d}-{pattern.framework}-{pattern.name}-{pattern.ranks}"
        reference = run_job(pattern, group / "reference", (), placement)
        problem = reference_problem(reference, pattern.framework)
        for number, (fault, extra) in enumerate(pattern.faults):
            if problem is None:
                run = run_job(pattern, group / f"fault-{number}", extra, placement)
                result, kinds = judge(run, reference, pattern.framework), recovery_kinds(
                    run.events)
                seconds = kill_to_first_step(run)
                first = "-" if seconds is None else f"{seconds:.2f} s"
            else:
                result, kinds, first = problem, "-", "-"
            row = Row(pattern.name, pattern.framework, str(pattern.ranks), fault, result,
                      kinds, first)
            rows.append(row)
            print(text_row(row), file=progress, flush=True)
    if not args.quick and not args.only and not placement:
        for name, framework, fault, why in NOT_ON_CPU:
            row = Row(name, framework, "2", fault, f"not run: {why}", "-", "-")
            rows.append(row)
            print(text_row(row), file=progress, flush=True)

    bad = [row for row in rows if not row.ok]
    counted = [row for row in rows if not row.result.startswith("not run")]
    exact = sum(row.result == "exact" for row in counted)
    refused = sum(row.result.startswith("refused") for row in counted)
    took = time.monotonic() - started
    if args.markdown:
        print(markdown(rows))
    print(f"# {len(counted)} cells: {exact} exact, {refused} refused, {len(bad)} neither; took "
          f"{took // 60:.0f} min {took % 60:.0f} s (load average {os.getloadavg()[0]:.1f})",
          flush=True)
    if bad or args.keep:
        print(f"# run directories kept: {work}", flush=True)
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 1 if bad else 0


def torch_version() -> str:
    import torch

    return torch.__version__


if __name__ == "__main__":
    sys.exit(main())
