"""``elasticft report``: the reliability report of a run, and the what-if model.

    elasticft report RUN_DIR [--json] [--plot timeline.png]
    elasticft report --what-if --mtbf 3600 --ckpt-cost 30 --recovery 120 [--interval 600]
                     [--lost-work S] [--slow-recovery S --slow-ratio R] [--json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from elasticft import extras
from elasticft.events import failures_heard_lines, read_events, sdc_line, snapshots_skipped_line
from elasticft.report import whatif
from elasticft.report.eventsonly import format_summary, summarize
from elasticft.report.tor import ReportError, StepsUnknown, analyze, format_report
from elasticft.steps import read_steps


def _cmd_report(args: argparse.Namespace) -> int:
    from elasticft.cli import CliError

    if args.what_if:
        return _what_if(args)
    if args.run_dir is None:
        raise CliError("give a RUN_DIR (the run's event directory) or --what-if")
    run_dir = Path(args.run_dir)
    if not run_dir.is_dir():
        raise CliError(f"run directory {run_dir} does not exist; give the --run-dir of the run")
    if args.plot:
        extras.require(extras.MATPLOTLIB, "elasticft report --plot", "report")
    events = read_events(run_dir)
    try:
        analysis = analyze(events, read_steps(run_dir))
    except StepsUnknown as e:
        if not any(event["kind"] == "run_start" for event in events):
            raise CliError(f"{run_dir}: no run_start event in the event log; is this a run "
                           "directory?") from None
        summary = summarize(events, str(e))
        return _print(args, events, summary.to_json(), format_summary(summary),
                      f"no timeline drawn: {summary.why_no_tor}")
    except ReportError as e:
        raise CliError(f"{run_dir}: {e}") from None
    if args.plot:
        from elasticft.report.plot import plot_timeline

        plot_timeline(analysis, args.plot)
    return _print(args, events, analysis.to_json(), f"{format_report(analysis)}\n",
                  f"timeline: {args.plot}")


def _print(args: argparse.Namespace, events: list[dict[str, Any]], report: dict[str, Any],
           report_text: str, plot_line: str) -> int:
    """The report and the event log's lines on skipped snapshots, silent data corruption and
    failures heard, as JSON (``--json``) or as text, with a line about the ``--plot`` asked
    for."""
    skipped, skipped_text = snapshots_skipped_line(events)
    sdc, sdc_text = sdc_line(events)
    heard, heard_text = failures_heard_lines(events)
    as_json = report | {"snapshots_skipped": skipped, "sdc": sdc, "failures_heard": heard}
    text = f"{report_text}\n  {skipped_text}\n  {sdc_text}\n  {heard_text}"
    if args.json:
        print(json.dumps(as_json, indent=2))
    else:
        print(text)
        if args.plot:
            print(f"\n  {plot_line}")
    return 0


def _what_if(args: argparse.Namespace) -> int:
    from elasticft.cli import CliError

    missing = [f"--{n.replace('_', '-')}" for n in ("mtbf", "ckpt_cost", "recovery")
               if getattr(args, n) is None]
    if missing:
        raise CliError(f"--what-if needs {', '.join(missing)} (seconds)")
    try:
        scenario = whatif.Scenario(args.mtbf, args.ckpt_cost, args.recovery,
                                   args.slow_recovery, args.slow_ratio)
        best = whatif.optimal_interval(scenario)
        interval = args.interval or best
        tor = whatif.predicted_tor(scenario, interval, args.lost_work)
        best_tor = whatif.predicted_tor(scenario, best)
    except ValueError as e:
        raise CliError(str(e)) from None
    result: dict[str, Any] = {
        "mtbf_s": args.mtbf,
        "ckpt_cost_s": args.ckpt_cost,
        "recovery_s": args.recovery,
        "slow_recovery_s": args.slow_recovery,
        "slow_recovery_ratio": args.slow_ratio,
        "interval_s": interval,
        "lost_work_s": (args.lost_work if args.lost_work is not None
                        else whatif.lost_work(interval, args.ckpt_cost)),
        "predicted_tor": tor,
        "optimal_interval_s": best,
        "optimal_tor": best_tor,
        "young_interval_s": whatif.young_interval(scenario),
        "daly_interval_s": whatif.daly_interval(scenario),
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"what-if: MTBF {args.mtbf:g} s, checkpoint {args.ckpt_cost:g} s, recovery "
          f"{args.recovery:g} s" + (f", slow recovery {args.slow_recovery:g} s at "
                                   f"{args.slow_ratio:g}x" if args.slow_recovery else ""))
    print(f"  at interval {interval:.1f} s (lost work {result['lost_work_s']:.1f} s): "
          f"predicted TOR {tor:.4f}")
    print(f"  best interval {best:.1f} s of training between checkpoints: TOR {best_tor:.4f}")
    print(f"  (Young sqrt(2*C*MTBF) {result['young_interval_s']:.1f} s; Daly "
          f"{result['daly_interval_s']:.1f} s)")
    print("  interval (s)   TOR")
    for factor in (0.25, 0.5, 1.0, 2.0, 4.0):
        t = best * factor
        print(f"  {t:12.1f}   {whatif.predicted_tor(scenario, t):.4f}")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "report",
        help="TOR, ETTR, MTBF and the per-failure cost of a run; --what-if for the model",
        description="Reliability report of a run directory (its event log and step records), "
        "or with --what-if the TOR model's prediction and best checkpoint interval.",
    )
    p.add_argument("run_dir", nargs="?", type=Path, help="the run's directory (--run-dir)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--plot", type=Path, metavar="OUT.png", help="draw the timeline to a PNG")
    w = p.add_argument_group("what-if (seconds)")
    w.add_argument("--what-if", action="store_true", help="predict TOR instead of reporting")
    w.add_argument("--mtbf", type=float, help="mean running time between failures")
    w.add_argument("--ckpt-cost", type=float, help="training stall of one checkpoint")
    w.add_argument("--recovery", type=float, help="repair: detect, restart, reload")
    w.add_argument("--interval", type=float,
                   help="training time between checkpoints (default: the best one)")
    w.add_argument("--lost-work", type=float,
                   help="work lost per failure (default: half a checkpoint period)")
    w.add_argument("--slow-recovery", type=float, default=0.0,
                   help="time running slowly after a restart")
    w.add_argument("--slow-ratio", type=float, default=1.0,
                   help="relative speed while recovering (0-1)")
    p.set_defaults(handler=_cmd_report)
