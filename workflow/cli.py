"""The `optimus` command: the composition root. It parses, picks where to run, calls a stage.

    optimus corpus    --out results/data/corpus
    optimus tokenize  --corpus results/data/corpus --out results/data/tokens --workers 2
    optimus pretrain  --preset mula-7b-a1b@laptop --data results/data/tokens --out results/runs/x \\
                      --steps 200 --store results/store.zarr --set optim.lr=1e-3
    optimus pretrain  --experiment pretrain-mula-7b-a1b --scale laptop --data ... --out ...
    optimus evaluate  --run results/runs/x --store results/store.zarr
    optimus figures   --store results/store.zarr --out results/figures
    optimus report    --store results/store.zarr --figures results/figures --out results/report.md
    optimus scaling   --preset mula-7b-a1b@laptop --devices 1 2 --store results/store.zarr
    optimus perfmodel --store results/store.zarr --measured bench/results/distributed-strong-weak-nvidia-h200.jsonl \\
                      --out results/perfmodel.json
    optimus execution --preset mula-7b-a1b --device cuda      # which kernels run there, and why
    optimus presets | optimus experiments

Every command prints a short summary for a person on stdout, or with ``--json`` one JSON object
for a program (progress and logs go to stderr either way). A configuration, input or environment
error is one line on stderr: exit 2 for configuration and usage (fails wherever it runs), 1 for
input data and the environment (an output that cannot be written, a device that is not here); it
names the user's path, never a temporary one, and ``--debug`` adds its traceback. A reader that
closes the pipe early (``| head``) ends the command quietly with 141. Any other
failure keeps its traceback (workflow.failures). The commands themselves are in
workflow.commands. Stages never import either (imports point one way: workflow -> stages ->
optimus_core -> kernels); Snakemake rules and Parsl apps call this command.
"""
from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

from optimus_core.log import configure_logging
from workflow.commands import (cmd_corpus, cmd_evaluate, cmd_execution, cmd_experiments, cmd_export_hf, cmd_figures,
                               cmd_hosts, cmd_perfmodel, cmd_plan, cmd_presets, cmd_pretrain, cmd_reference,
                               cmd_rehearse, cmd_report, cmd_scaling, cmd_task_data, cmd_tokenize, cmd_warm_cache,
                               cmd_window_order, emit)
from workflow.experiments import DESIGNS
from workflow.failures import check_site_use, user_failure


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage error in one line (exit 2) instead of the usage block and the error."""

    def error(self, message):
        self.exit(2, f"{self.prog}: usage error: {message} (`{self.prog} --help` lists the options)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="optimus", description=__doc__.split("\n")[0])
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--json", action="store_true", help="print one JSON object on stdout instead of the summary")
    common.add_argument("--debug", action="store_true",
                        help="debug logging on every rank; a configuration or input error shows its traceback")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("corpus", parents=[common], help="build the embedded corpus, or index an OLMoE-mix download")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--from", dest="from_dir", type=Path, default=None, help="an OLMoE-mix-0924 directory")
    p.add_argument("--files-list", type=Path, default=None,
                   help="with --from: index only the files listed (a line each: <source>/<file> or its URL; e.g. "
                        "the authors' urls.txt), so that the windows are the paper's files'")
    p.set_defaults(func=cmd_corpus)

    p = sub.add_parser("tokenize", parents=[common], help="Dolma JSONL -> token arrays + indices + manifest")
    p.add_argument("--corpus", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tokenizer", type=Path, default=None, help="tokenizer.json (default: train a BPE)")
    p.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 1)))
    p.add_argument("--vocab-size", type=int, default=None, help="size of the BPE trained when no tokenizer is given")
    p.add_argument("--skip-bad-records", action="store_true")
    p.add_argument("--launcher", choices=("local", "parsl"), default="local",
                   help="local: --workers processes here; parsl: one task per corpus file on --site's CPU executor "
                        "(needs --tokenizer; unchanged files are not redone)")
    p.add_argument("--site", default=None, help="with --launcher parsl: local, aurora, or a YAML file with a site: block")
    p.add_argument("--shards", type=Path, default=None,
                   help="with --launcher parsl: the per-file shards, kept for reruns (default: OUT.shards)")
    p.set_defaults(func=cmd_tokenize)

    p = sub.add_parser("pretrain", parents=[common], help="train one run")
    p.add_argument("--preset", default=None)
    p.add_argument("--experiment", default=None, help="a run of workflow/experiments.py")
    p.add_argument("--scale", choices=("laptop", "paper"), default=None,
                   help="with --experiment: its laptop (default) or paper configuration")
    p.add_argument("--layout", choices=DESIGNS, default=None,
                   help="with --experiment --scale paper: the authors' layout (default) or our design of the run")
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True, help="the run directory")
    p.add_argument("--run-id", default=None, help="default: the run directory's name")
    p.add_argument("--steps", type=int)
    p.add_argument("--nproc", type=int, default=1,
                   help="local ranks to start (CPU or one per GPU); under torchrun / mpiexec: 1 or the world size")
    p.add_argument("--ep", type=int, help="expert-parallel ranks (divides --nproc and the expert count)")
    p.add_argument("--pp", type=int, help="pipeline stages the layers are cut into (parallel.pp; --pp x --ep "
                                          "divides --nproc)")
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16"),
                   help="execution.dtype (default auto: bf16 autocast on a GPU, float32 on a CPU)")
    p.add_argument("--seed", type=int)
    p.add_argument("--experts-backend", choices=("auto", "loop", "torch", "triton"),
                   help="execution.experts (default auto: the fastest that validated on the device)")
    p.add_argument("--checkpoint-every", type=int)
    p.add_argument("--max-restarts", type=int, default=None,
                   help="rerun a run that crashed, hung (watchdog) or was stopped, up to R times, each time "
                        "resuming from the newest valid checkpoint (local launcher; default 0)")
    p.add_argument("--start-over", action="store_true",
                   help="where --out holds checkpoints and none is valid: set them aside (checkpoints/invalid/) "
                        "and train from step 0, instead of stopping")
    p.add_argument("--store", type=Path, default=None)
    p.add_argument("--launcher", choices=("local", "parsl"), default="local")
    p.add_argument("--site", default=None)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (CPU)")
    p.add_argument("--quiet", action="store_true", help="no progress bar and no info lines (the plan, resumes): warnings and errors only")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    p.set_defaults(func=cmd_pretrain)

    p = sub.add_parser("evaluate", parents=[common], help="held-out loss / perplexity / bits per byte; lm-eval downstream tasks")
    p.add_argument("--run", type=Path, required=True)
    p.add_argument("--data", type=Path, default=None)
    p.add_argument("--tasks", nargs="+", default=["heldout"],
                   help="heldout, continuation (offline multiple choice per source), docstring (offline multiple "
                        "choice on held-out code), or lm-eval task names")
    p.add_argument("--task-dir", action="append", default=None, help="a directory of lm-eval task YAMLs (repeatable)")
    p.add_argument("--limit", type=int, default=None, help="lm-eval: at most N documents per task")
    p.add_argument("--items", type=int, default=200, help="continuation: items per corpus source; docstring: at most")
    p.add_argument("--all-checkpoints", action="store_true",
                   help="held-out metrics of every kept checkpoint (a heldout row each); downstream: newest only")
    p.add_argument("--downstream-all-checkpoints", action="store_true",
                   help="downstream tasks on every kept checkpoint too (implies --all-checkpoints)")
    p.add_argument("--max-batches", type=int, default=64)
    p.add_argument("--store", type=Path, default=None)
    p.add_argument("--out", type=Path, default=None, help="default: RUN/eval.json")
    p.add_argument("--nproc", type=int, default=1,
                   help="ranks: > 1 evaluates held-out metrics on the model sharded over them (as trained)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "xpu"],
                   help="the ranks' device when sharded; one process: cuda or xpu evaluates on that device, "
                        "auto and cpu on the CPU")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--launcher", choices=("local", "parsl"), default="local",
                   help="parsl: a compute job of --nproc ranks (default: the run's) on --site")
    p.add_argument("--site", default=None, help="with --launcher parsl: local, aurora, or a YAML file with a site: block")
    p.set_defaults(func=cmd_evaluate)

    p = sub.add_parser("export-hf", parents=[common], help="a run's newest checkpoint as a Hugging Face transformers directory")
    p.add_argument("--run", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--data", type=Path, default=None, help="tokenize output with the tokenizer (default: the run's)")
    p.add_argument("--arch", choices=["olmoe", "llama", "olmo"], default=None, help="default: the exact one for the model")
    p.set_defaults(func=cmd_export_hf)

    p = sub.add_parser("figures", parents=[common], help="draw every figure (or those named by --only) from the results store")
    p.add_argument("--store", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--only", action="extend", nargs="+", metavar="NAME", default=None,
                   help="draw only these figures (file names such as scaling.png ablation.png)")
    p.add_argument("--skip-damaged", action="store_true",
                   help="draw the store's healthy runs, naming the damaged ones left out (default: refuse)")
    p.set_defaults(func=cmd_figures)

    p = sub.add_parser("reference", parents=[common], help="a reference model's published downstream scores "
                                                            "(a workflow/reference/*.yaml file) into the results store")
    p.add_argument("--file", type=Path, required=True)
    p.add_argument("--store", type=Path, required=True)
    p.set_defaults(func=cmd_reference)

    p = sub.add_parser("report", parents=[common], help="write the markdown report from the results store")
    p.add_argument("--store", type=Path, required=True)
    p.add_argument("--figures", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--skip-damaged", action="store_true",
                   help="report the store's healthy runs, naming the damaged ones left out (default: refuse)")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("window-order", parents=[common],
                       help="draw the paper's window order once, beside the tokens, for every rank to memory-map")
    p.add_argument("--data", type=Path, required=True, help="an `optimus tokenize` output")
    p.add_argument("--seq-len", type=int, default=2048, help="the window (data.seq_len)")
    p.add_argument("--seed", type=int, default=42, help="the order's seed (data.seed)")
    p.add_argument("--epochs", type=int, default=1, help="orders of this many epochs (each its own file)")
    p.add_argument("--launcher", choices=("local", "parsl"), default="local",
                   help="parsl: drawn by one process on one node of --site (a compute node's memory)")
    p.add_argument("--site", default=None, help="with --launcher parsl: local, aurora, or a YAML file with a site: block")
    p.set_defaults(func=cmd_window_order)

    p = sub.add_parser("hosts", parents=[common],
                       help="inside a PBS job: the hostfile of its healthy nodes (those a run named faulty left out)")
    p.add_argument("--nodes", type=int, required=True, help="the hosts the ranks need")
    p.add_argument("--out", type=Path, required=True, help="the hostfile to write (one host a line)")
    p.add_argument("--faults", type=Path, default=None, help="a run's node-faults.json (absent: none named)")
    p.add_argument("--nodefile", type=Path, default=None, help="default: $PBS_NODEFILE")
    p.set_defaults(func=cmd_hosts)

    p = sub.add_parser("task-data", parents=[common],
                       help="load lm-eval's tasks once (internet needed), caching their data for offline evaluations")
    p.add_argument("--tasks", nargs="+", required=True, help="lm-eval task names (e.g. the paper's nine)")
    p.add_argument("--task-dir", action="append", default=None, help="a directory of lm-eval task YAMLs (repeatable)")
    p.set_defaults(func=cmd_task_data)

    p = sub.add_parser("warm-cache", parents=[common],
                       help="fill the site's shared compile cache once (one node): every later job starts from it")
    p.add_argument("--site", required=True, help="the site whose compile_cache to fill (aurora, or a YAML file)")
    p.add_argument("--experiment", nargs="*", default=[], help="registry runs (default: every paper-scale run)")
    p.add_argument("--steps", type=int, default=2, help="rehearsed steps of each run (the kernels' shapes)")
    p.set_defaults(func=cmd_warm_cache)

    p = sub.add_parser("presets", parents=[common], help="the table of model presets")
    p.add_argument("--seq-len", type=int, default=None)
    p.set_defaults(func=cmd_presets)

    p = sub.add_parser("scaling", parents=[common], help="a strong-scaling sweep on this machine: step time by phase per device count")
    p.add_argument("--preset", required=True, help="a model preset, e.g. mula-7b-a1b@laptop")
    p.add_argument("--devices", type=int, nargs="+", default=[1, 2], help="device (rank) counts to sweep")
    p.add_argument("--ep", nargs="+", default=["all"],
                   help="EP rules, each swept: 'all' (ep = ranks of each point) and/or fixed EP degrees")
    p.add_argument("--optimizer", choices=["ep_aware", "dp_sharded"], default="ep_aware")
    p.add_argument("--global-batch", type=int, default=0, help="sequences per step, fixed (0: the preset's)")
    p.add_argument("--micro-batch", type=int, default=0, help="sequences per forward/backward (0: all local)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per point (median taken)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    p.add_argument("--fitted", nargs="+", default=[], metavar="BATCH[:MICRO]",
                   help="extra fitted settings of a held-out design, also swept (e.g. 16:2: tells the model's "
                        "per-call latency from its per-byte cost)")
    p.add_argument("--holdout", nargs="+", default=[], metavar="BATCH[:MICRO]",
                   help="held-out settings, also swept: their multi-rank points are predicted, not fitted")
    p.add_argument("--rounds", type=int, default=1,
                   help="interleaved passes over every layout (the fastest kept: load only slows a step)")
    p.add_argument("--retries", type=int, default=0,
                   help="more passes, at most, over layouts whose kept (fastest) pass waited for a core (other work)")
    p.add_argument("--max-cpu-wait", type=float, default=0.1,
                   help="share of a pass its ranks may wait for a core before it counts as loaded")
    p.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda", "xpu"])
    p.add_argument("--threads", type=int, default=1, help="CPU threads per rank")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override, repeatable")
    p.add_argument("--store", type=Path, default=None, help="results store to write the points to")
    p.add_argument("--jsonl", type=Path, default=None, help="also write the points here, one JSON line each")
    p.add_argument("--run-id", default=None, help="store run id (default scaling-<preset>-<device>)")
    p.set_defaults(func=cmd_scaling)

    p = sub.add_parser("perfmodel", parents=[common], help="calibrate the performance model on measured sweeps, held-out errors, "
                                         "and the paper's sweep predicted on Aurora")
    p.add_argument("--store", type=Path, default=None,
                   help="results store: reads its `optimus scaling` runs, writes run 'perfmodel'")
    p.add_argument("--measured", type=Path, nargs="*", default=[],
                   help="JSON-lines files of measured points (the strong suite of bench/distributed.py)")
    p.add_argument("--out", type=Path, default=None, help="also write the study here as JSON")
    p.set_defaults(func=cmd_perfmodel)

    p = sub.add_parser("rehearse", parents=[common], help="one rank of a paper layout on this machine's device (the other ranks "
                                        "stood in for by torch's fake process group): its peak memory beside the model's")
    p.add_argument("--experiment", nargs="*", default=[], help="registry runs (default: every paper-scale run)")
    p.add_argument("--tiles", type=int, nargs="*", default=[],
                   help="rehearse each run at these tile counts instead of its own (its batch raised to a "
                        "sequence per tile where needed, sharded in blocks of at most 384 tiles)")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=2,
                   help="of each rank's micro-batches per step (0: all; the peak is reached by the second)")
    p.add_argument("--device", default="cuda", choices=["cuda", "xpu", "cpu", "meta"],
                   help="meta: no device, the shares' sizes only (checked against the memory model)")
    p.add_argument("--site", default="aurora", help="whose machine's memory budget the layouts are planned for")
    p.add_argument("--checkpointing", default=None, metavar="MODE",
                   help="none, moe, full, full/K or level1..level7: rehearse this activation checkpointing instead "
                        "of the one the plan resolves (to measure a choice before the plan makes it)")
    p.add_argument("--weight-gathers", choices=["per_micro_batch", "per_step"], default=None,
                   help="rehearse a sharded rank's weights gathered this way instead of the plan's way (to "
                        "measure a choice before the plan makes it)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override each run's config (e.g. parallel.pp_chunks=2): a layout the registry does not run")
    p.add_argument("--layout", choices=DESIGNS, default=None,
                   help="the runs in the authors' layout (default) or our design")
    p.add_argument("--no-save", action="store_true", help="skip the checkpoint write after the steps")
    p.add_argument("--site-account", default="rehearsal", help=argparse.SUPPRESS)
    p.add_argument("--jsonl", type=Path, default=None, help="write the records here (bench/results/rehearsal-*.jsonl)")
    p.add_argument("--store", type=Path, default=None)
    p.add_argument("--ingest", type=Path, default=None, help="put a rehearsal file into --store and exit")
    p.set_defaults(func=cmd_rehearse)

    p = sub.add_parser("execution", parents=[common], help="how a run would execute on a device: each kernel "
                       "and execution choice with its reason (the run's execution plan)")
    p.add_argument("--preset", default=None)
    p.add_argument("--experiment", default=None, help="a registry run, at --scale, on its own number of ranks")
    p.add_argument("--scale", choices=("paper", "laptop"), default="paper")
    p.add_argument("--layout", choices=DESIGNS, default=None, help="the authors' layout (default) or our design")
    p.add_argument("--device", default="auto", help="cpu, cuda or xpu (default: this machine's); a device not "
                   "here is planned from its type")
    p.add_argument("--world", type=int, default=None, help="ranks (default: 1, or the experiment's tiles)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override, repeatable")
    p.set_defaults(func=cmd_execution)

    p = sub.add_parser("experiments", parents=[common], help="the registry of runs")
    p.set_defaults(func=cmd_experiments)

    p = sub.add_parser("plan", parents=[common], help="the paper-scale jobs on a site, with nodes, walltime and node-hours")
    p.add_argument("--site", default="aurora", help="local, aurora, or a YAML file with a site: block")
    p.add_argument("--pbs", action="store_true", help="also print each job's PBS directives and mpiexec line")
    p.add_argument("--store", type=Path, default=None,
                   help="also record the pretraining runs' shapes, recipe and plan in this results store (the report's "
                        "table of the paper's runs)")
    p.add_argument("--layout", choices=DESIGNS, default=None,
                   help="the runs in the authors' layout (default) or our design, where a run has one")
    p.add_argument("experiments", nargs="*", help="default: every run of the paper-scale DAG")
    p.set_defaults(func=cmd_plan)
    return parser


BROKEN_PIPE_EXIT_CODE = 141  # 128 + SIGPIPE, as a shell reports a writer whose reader closed the pipe
INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT, as a shell reports Ctrl-C


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    configure_logging(debug=args.debug, quiet=getattr(args, "quiet", False))  # a command that knows its rank sets it again
    from optimus_core.train.resilience import Preempted

    try:
        check_site_use(args)
        summary = args.func(args)
    except Preempted as e:  # the scheduler asked us to stop: the launcher reruns, which resumes
        print(f"optimus {args.command}: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:  # Ctrl-C in a command that is not a training run (that one checkpoints)
        print(f"optimus {args.command}: interrupted (Ctrl-C); nothing unfinished was published: rerun it to "
              f"start again", file=sys.stderr)
        return INTERRUPTED_EXIT_CODE
    except SystemExit as e:  # the status of the ranks or attempts this command launched (they said why)
        if not isinstance(e.code, int):
            raise
        return e.code
    except Exception as e:  # noqa: BLE001  (a bug is re-raised, with its traceback)
        failure = user_failure(args, e)
        if failure is None:
            raise
        if args.debug:
            traceback.print_exception(e, file=sys.stderr)
        print(failure[1], file=sys.stderr)
        return failure[0]
    try:
        emit(summary, args.json)
    except BrokenPipeError:  # the reader left (`optimus presets | head`): stop quietly, as a shell tool does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit's flush must not fail again
        return BROKEN_PIPE_EXIT_CODE
    return 0


if __name__ == "__main__":
    sys.exit(main())
