"""The `optimus` commands: each parses nothing, checks what it can before any work, calls one
stage (or a launcher that runs it elsewhere) and returns a Summary (workflow.cli parses and
prints). Stages never import this module; Snakemake rules and Parsl apps run the command.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import tempfile
import traceback
from dataclasses import dataclass
from pathlib import Path

from optimus_core.config import ConfigError, parse_value
from optimus_core.log import configure_logging
from workflow.failures import check_file_output, check_writable, is_report, json_with, user_failure


@dataclass
class Summary:
    """What a command did: ``text`` for a person, ``data`` (JSON-able) for ``--json``."""

    text: str
    data: dict


def jsonable(value):
    """``value`` with paths as strings, dataclasses as dicts and NaN / inf as null (strict JSON)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _rank_logging(args, launch) -> None:
    configure_logging(launch.rank, launch.world_size, debug=getattr(args, "debug", False),
                      quiet=getattr(args, "quiet", False))


def emit(summary: Summary | None, as_json: bool) -> None:
    if summary is not None:
        print(json.dumps(summary.data, allow_nan=False) if as_json else summary.text, flush=True)


def _site_summary(done, args, fallback: str) -> Summary:
    """The summary the job printed last (its JSON object under --json: the flag travels with it)."""
    line = done.last_line()
    job = json.loads(line) if args.json and line.startswith("{") else line
    return Summary(line or fallback, jsonable({"site": args.site, "stdout": done.stdout, "seconds": done.seconds,
                                               "job": job}))


def _run_in_own_process(command, args, reports: str | None = None) -> None:
    """A spawned rank or a restart attempt: the process that runs ``command`` prints its summary;
    stopped by a signal after its checkpoint, it exits with the stop status (rank 0 says why).
    A failure the user can fix (user_failure) ends it with that status, its one line written to
    ``reports``/rank-<RANK> for the launching process to say once (printed where ``reports`` is
    None); a bug keeps its traceback."""
    from optimus_core.train.resilience import Preempted

    try:
        emit(command(args), args.json)
    except Preempted as e:
        if os.environ.get("RANK", "0") == "0":
            print(f"optimus {args.command}: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    except Exception as e:  # noqa: BLE001  (a bug is re-raised, with its traceback)
        failure = user_failure(args, e)
        if failure is None:
            raise
        status, line = failure
        if args.debug:
            traceback.print_exception(e, file=sys.stderr)
        if reports is None:
            print(line, file=sys.stderr)
        else:
            Path(reports, f"rank-{int(os.environ.get('RANK', '0')):06d}").write_text(f"{status}\t{line}\n")
        sys.exit(status)


def reported_failure(reports: str | Path) -> tuple[int, list[str]] | None:
    """(the lowest failing rank's status, each distinct line once, in rank order) of the failures
    that processes running _run_in_own_process wrote into ``reports``; None when none wrote one.
    Ranks that failed alike say it once; different failures each name their rank."""
    found = []
    for path in sorted(Path(reports).glob("rank-*")):
        status, _, line = path.read_text().rstrip("\n").partition("\t")
        found.append((int(path.name.removeprefix("rank-")), int(status), line))
    if not found:
        return None
    ranks: dict[str, list[int]] = {}
    for rank, _, line in found:
        ranks.setdefault(line, []).append(rank)
    if len(ranks) == 1:
        return found[0][1], list(ranks)
    return found[0][1], [f"{line} (rank{'s' if len(r) > 1 else ''} {', '.join(map(str, r))})"
                         for line, r in ranks.items()]


def parse_overrides(pairs: list[str]) -> dict:
    """``--set`` pairs (``train.steps=100``) as a dict of parsed values; a pair without '=' is a ConfigError."""
    out = {}
    for pair in pairs or []:
        key, _, value = pair.partition("=")
        if "=" not in pair or not key.strip():
            raise ConfigError(f"--set {pair!r}: expected key=value, e.g. train.steps=100")
        out[key.strip()] = parse_value(value)
    return out



def cmd_corpus(args) -> Summary:
    from stages.corpus import CorpusConfig, CorpusInputs, CorpusOutputs, run_corpus

    if args.files_list is not None and args.from_dir is None:
        raise ConfigError("--files-list: only with --from (it chooses the files of a download to index)")
    result = run_corpus(CorpusConfig(), CorpusInputs(from_dir=args.from_dir, files_list=args.files_list),
                        CorpusOutputs(out_dir=args.out))
    how = "indexed in place" if result.indexed else "built"
    per_source = ", ".join(f"{src} {n} file(s)" + (f" / {result.docs[src]:,} docs" if src in result.docs else "")
                           for src, n in sorted(result.files.items()))
    return Summary(f"{result.out_dir}: corpus {how}, {sum(result.files.values())} file(s), "
                   f"{sum(result.file_bytes.values()) / 2**20:,.1f} MiB ({per_source})", jsonable(result))


def cmd_tokenize(args) -> Summary:
    from stages.tokenize import TokenizeConfig, TokenizeInputs, TokenizeOutputs, run_tokenize

    if args.vocab_size is not None and args.tokenizer is not None:
        raise ConfigError(f"--vocab-size {args.vocab_size} is the size of the BPE trained when no --tokenizer is "
                          f"given; with --tokenizer {args.tokenizer} the vocabulary is the tokenizer's: give one")
    if args.shards is not None and args.launcher != "parsl":
        raise ConfigError(f"--shards {args.shards} is used only with --launcher parsl (this command tokenizes here, "
                          f"without shards)")
    config = TokenizeConfig(workers=args.workers, skip_bad_records=args.skip_bad_records,
                            **({"vocab_size": args.vocab_size} if args.vocab_size is not None else {}))
    inputs, outputs = TokenizeInputs(corpus_dir=args.corpus, tokenizer=args.tokenizer), TokenizeOutputs(out_dir=args.out)
    if args.launcher == "parsl":  # one Parsl task per corpus file on the site's CPU executor, then the merge
        from workflow.parsl_sites import parsl_cpu_config
        from workflow.sites import load_site
        from workflow.tokenize_fanout import default_shards, tokenize_fanout

        if not args.site:
            raise ConfigError("site = None: --launcher parsl needs --site NAME (local, aurora, or a YAML file)")
        site = load_site(args.site)
        shards = args.shards or default_shards(args.out)
        parsl_config = parsl_cpu_config(site, Path(site.run_dir).resolve() / f"tokenize-{Path(args.out).name}")
        result, done = tokenize_fanout(config, inputs, outputs, shards, parsl_config)
        fanout = {"site": site.name, "tokenized": sum(v == "tokenized" for v in done.values()),
                  "reused": sum(v == "reused" for v in done.values()), "shards": shards}
    else:
        result, fanout = run_tokenize(config, inputs, outputs), None
    splits = {split: {"docs": sum(t.docs for t in by_source.values()),
                      "tokens": sum(t.tokens for t in by_source.values())}
              for split, by_source in result.totals.items()}
    text = (f"{result.out_dir}: {result.files} token file(s), vocab {result.vocab_size:,} ({result.dtype}"
            f"{', tokenizer trained here' if result.trained_tokenizer else ''}); "
            + ", ".join(f"{split} {n['tokens']:,} tokens in {n['docs']:,} docs" for split, n in splits.items()))
    if result.skipped:
        text += "; skipped " + ", ".join(f"{n} {why}" for why, n in sorted(result.skipped.items()))
    if fanout:
        text += (f"\nsite {fanout['site']}: {fanout['tokenized']} file(s) tokenized, "
                 f"{fanout['reused']} reused from {fanout['shards']}")
    return Summary(text, jsonable({**dataclasses.asdict(result), "splits": splits,
                                   **({"parsl": fanout} if fanout else {})}))


# pretrain's flags that set a config field (a --set of the same field must agree with them)
FLAG_FIELDS = {"train.steps": "--steps", "train.seed": "--seed", "execution.dtype": "--dtype",
               "train.checkpoint_every": "--checkpoint-every", "parallel.ep": "--ep", "parallel.pp": "--pp",
               "execution.experts": "--experts-backend"}


def _layout(args) -> str:
    """The design ``--layout`` names (workflow.experiments.DESIGNS), the authors' where not given."""
    from workflow.experiments import AUTHORS

    return getattr(args, "layout", None) or AUTHORS


def resolve_run_config(args):
    """Preset (or experiment) + flags + --set overrides -> a validated RunConfig and run id."""
    from optimus_core import presets

    overrides: dict = {}
    run_id, experiment = args.run_id, ""
    if args.experiment and args.preset:
        raise ConfigError(f"--preset {args.preset} and --experiment {args.experiment}: give one (an experiment "
                          f"names its own preset)")
    if getattr(args, "layout", None) and not args.experiment:
        raise ConfigError(f"--layout {args.layout} chooses an --experiment's paper-scale design; a --preset has one "
                          f"configuration")
    if args.scale and not args.experiment:
        raise ConfigError(f"--scale {args.scale} chooses an --experiment's configuration; a --preset has one "
                          f"(a laptop preset is named NAME@laptop)")
    if args.experiment:
        from workflow.experiments import get as get_experiment

        exp = get_experiment(args.experiment)
        scale = exp.scale(args.scale or "laptop", _layout(args))
        preset_name, overrides = scale.preset, dict(scale.overrides())
        run_id, experiment = run_id or exp.run_id(args.scale or "laptop", _layout(args)), exp.name
    elif args.preset:
        preset_name = args.preset
    else:
        raise ConfigError("pretrain needs --preset NAME or --experiment NAME (see `optimus presets`)")
    flags = {field: (flag, getattr(args, flag[2:].replace("-", "_"))) for field, flag in FLAG_FIELDS.items()}
    given = {field: value for field, (_, value) in flags.items() if value is not None}
    sets = parse_overrides(args.set)
    clash = [field for field in given if field in sets and sets[field] != given[field]]
    if clash:  # neither silently wins
        field = clash[0]
        raise ConfigError(f"{flags[field][0]} {given[field]} and --set {field}={sets[field]} name the same field "
                          f"with different values: give one")
    overrides.update(given)
    overrides.update(sets)
    cfg = presets.get(preset_name).run_config(**overrides)
    return cfg, run_id or Path(args.out).name, experiment


def cmd_pretrain(args) -> Summary | None:
    cfg, run_id, experiment = resolve_run_config(args)
    if args.launcher == "parsl":  # the same command, submitted through a Parsl site (workflow/launch.py)
        from workflow.launch import pretrain_on_site

        done = pretrain_on_site(vars(args), run_id)
        return _site_summary(done, args, f"{run_id}: done on site {args.site}")
    from stages.pretrain import PretrainConfig, PretrainInputs, PretrainOutputs, run_pretrain

    from optimus_core.parallel.launch import spawn_local
    from optimus_core.parallel.mesh import read_launch_env
    from optimus_core.train.resilience import STOP_EXIT_CODES

    launch = read_launch_env()  # torchrun / mpiexec / our own spawn below, or a world of one
    _rank_logging(args, launch)
    if args.nproc < 1:
        raise ConfigError(f"--nproc = {args.nproc}: must be >= 1")
    if args.threads is not None and args.threads < 1:
        raise ConfigError(f"--threads = {args.threads}: must be >= 1")
    world = launch.world_size if launch.world_size > 1 else args.nproc
    # found before any rank is started, not by each of them
    from optimus_core.parallel.mesh import pipeline_layout

    pipeline_layout(world, cfg.parallel.pp, cfg.parallel.ep)
    data_world = cfg.parallel.stage_world(world)  # the ranks that read distinct sequences
    if cfg.train.global_batch % data_world:
        raise ConfigError(f"train.global_batch = {cfg.train.global_batch}: must be divisible by the data-parallel "
                          f"ranks ({data_world}" + (f" = {world} ranks / parallel.pp {cfg.parallel.pp})"
                                                    if cfg.parallel.pp > 1 else " ranks)"))
    if launch.world_size == 1:  # (a launcher's ranks bind their devices themselves, saying host and rank)
        from optimus_core.execution import check_launch

        check_launch(cfg, world)  # train.device is here and the explicit kernels run on it: before any rank or model
    check_writable(args.out)
    max_restarts = getattr(args, "max_restarts", None) or 0
    if max_restarts < 0:
        raise ConfigError(f"--max-restarts = {max_restarts}: must be >= 0")
    if max_restarts and launch.world_size > 1:
        raise ConfigError(f"--max-restarts = {max_restarts} under {launch.launcher} (world size "
                          f"{launch.world_size}): restart the whole job with that launcher instead")
    if max_restarts:
        # Each attempt is a fresh process running this command without --max-restarts; it resumes
        # from the newest valid checkpoint by itself.
        from optimus_core.train.restarts import ChildProcess, run_with_restarts

        once = argparse.Namespace(**dict(vars(args), max_restarts=0))
        with tempfile.TemporaryDirectory(prefix="optimus-attempts-") as reports:
            # An attempt that fails for a reason the user must fix (bad data, the run directory
            # busy with another job, a disk that refused a write) is not retried: a rerun fails alike.
            status = run_with_restarts(ChildProcess(_run_in_own_process, (cmd_pretrain, once, reports)), max_restarts,
                                       should_restart=lambda code: code not in STOP_EXIT_CODES
                                       and reported_failure(reports) is None)
            failure = reported_failure(reports)
        if failure is not None:
            print("\n".join(failure[1]), file=sys.stderr)
        if status:
            raise SystemExit(status)
        return None  # the last attempt printed the summary
    if args.nproc > 1 and launch.world_size == 1:
        from optimus_core.parallel.mesh import group_layout

        # A bad layout fails here, before any rank starts (the ranks check again themselves).
        group_layout(args.nproc // cfg.parallel.pp, cfg.parallel.ep, cfg.model.moe.n_experts if cfg.model.moe else None,
                     cfg.parallel.dp_shard)
        # No launcher around us: start the ranks here; each re-enters this function as one rank.
        from torch.multiprocessing import ProcessExitedException

        with tempfile.TemporaryDirectory(prefix="optimus-ranks-") as reports:
            try:
                spawn_local(_run_in_own_process, args.nproc, (cmd_pretrain, args, reports))
            except ProcessExitedException as e:
                if e.exit_code in STOP_EXIT_CODES:  # stopped on request after a checkpoint: rank 0 said so
                    raise SystemExit(e.exit_code) from None
                failure = reported_failure(reports)  # the ranks' one-line errors, each said once
                if failure is None:
                    raise
                print("\n".join(failure[1]), file=sys.stderr)
                raise SystemExit(failure[0]) from None
        return None  # rank 0 printed the summary
    if args.nproc not in (1, launch.world_size):
        raise ConfigError(f"--nproc = {args.nproc}: this process is rank {launch.rank} of {launch.world_size} "
                          f"started by {launch.launcher}; pass --nproc 1 or {launch.world_size}")
    threads = args.threads or (max(1, (os.cpu_count() or 1) // launch.world_size) if launch.world_size > 1 else None)
    if threads:
        import torch
        torch.set_num_threads(threads)
    result = run_pretrain(PretrainConfig(cfg, run_id=run_id, experiment=experiment, progress=not args.quiet,
                                         start_over=args.start_over),
                          PretrainInputs(data_dir=args.data), PretrainOutputs(run_dir=args.out, store=args.store))
    if launch.rank != 0:
        return None
    if result.already_finished:
        return Summary(f"{result.run_id}: finished at step {result.steps} already; nothing was trained or "
                       f"changed (a larger --steps continues it) -> {result.run_dir}", jsonable(result))
    resumed = f" (resumed from step {result.resumed_from})" if result.resumed_from else ""
    return Summary(f"{result.run_id}: {result.steps} steps{resumed}, {result.tokens:,} tokens, final loss "
                   f"{result.final_loss:.4f}, held-out loss {result.final_eval.get('loss', float('nan')):.4f}, "
                   f"{result.tokens_per_s:,.0f} tokens/s, {result.wall_time_s:,.0f} s -> {result.run_dir}",
                   jsonable(result))


def cmd_evaluate(args) -> Summary | None:
    if args.launcher == "parsl":  # the same command as a compute job of the site (workflow/launch.py)
        from workflow.launch import evaluate_on_site

        done = evaluate_on_site(vars(args))
        return _site_summary(done, args, f"{args.run}: evaluated on site {args.site}")
    from stages.evaluate import EvaluateConfig, EvaluateInputs, EvaluateOutputs, run_evaluate

    from optimus_core.parallel.launch import spawn_local
    from optimus_core.parallel.mesh import read_launch_env

    if args.nproc < 1:
        raise ConfigError(f"--nproc = {args.nproc}: must be >= 1")
    out = args.out or Path(args.run) / "eval.json"
    check_file_output(out, "--out" if args.out else "the default --out", "eval.json" if args.out else None,
                      inputs=[("--store", args.store), ("--data", args.data)], ours=json_with("run_id", "step"))
    check_writable(Path(out).parent)  # replaced whole: before evaluating
    launch = read_launch_env()
    _rank_logging(args, launch)
    if args.nproc > 1 and launch.world_size == 1:
        if set(args.tasks) != {"heldout"} and not (args.all_checkpoints or args.downstream_all_checkpoints):
            raise ConfigError(f"--tasks {' '.join(args.tasks)} with --nproc {args.nproc}: lm-eval's tasks need the "
                              f"whole model in one process, so the ranks share a run's checkpoints: add "
                              f"--all-checkpoints (or evaluate the newest checkpoint in one process)")
        from optimus_core.device import resolve_device_type

        resolve_device_type(args.device, field="--device")  # a device that is not here: said once, not per rank
        spawn_local(_run_in_own_process, args.nproc, (cmd_evaluate, args))  # each rank re-enters here
        return None
    config = EvaluateConfig(tasks=tuple(args.tasks), max_batches=args.max_batches,
                            task_dirs=tuple(args.task_dir or ()), limit=args.limit, n_items=args.items,
                            all_checkpoints=args.all_checkpoints or args.downstream_all_checkpoints,
                            downstream_all_checkpoints=args.downstream_all_checkpoints, dtype=args.dtype,
                            device=args.device)
    result = run_evaluate(config, EvaluateInputs(run_dir=args.run, data_dir=args.data),
                          EvaluateOutputs(eval_json=out, store=args.store))
    if launch.rank != 0:
        return None
    scalars = {k: v for k, v in result.metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    shown = ", ".join(f"{k} {v:.4g}" for k, v in scalars.items() if "." not in k)  # per source: in the JSON
    tasks = [k for k, v in result.metrics.items() if isinstance(v, dict)]
    counts = result.heldout_counts
    # the mean over this many batches: a run's own evaluation reads train.eval_batches of them instead
    over = (f" (held out: {counts['batches']} batches, {counts['sequences']} sequences; at most --max-batches "
            f"{args.max_batches} per source)" if counts.get("batches") else "")
    return Summary(f"{result.run_id} step {result.step} ({len(result.checkpoints)} checkpoint(s)): {shown}{over}"
                   + (f"; tasks {', '.join(tasks)}" if tasks else "") + f" -> {out}",
                   jsonable({"run_id": result.run_id, "step": result.step, "checkpoints": result.checkpoints,
                             "eval_json": out, **result.metrics}))


def cmd_export_hf(args) -> Summary:
    import importlib.util

    if importlib.util.find_spec("transformers") is None:  # before anything is read or written
        raise ValueError("export-hf needs transformers, which is not installed here; install the eval extra: "
                         "pip install -e '.[eval]'")
    from stages.export import ExportConfig, ExportInputs, ExportOutputs, run_export

    check_writable(Path(args.out).parent)  # built beside it, then renamed: before the checkpoint is read
    result = run_export(ExportConfig(arch=args.arch), ExportInputs(run_dir=args.run, data_dir=args.data),
                        ExportOutputs(out_dir=args.out))
    return Summary(f"{result.out_dir}: {result.arch} (step {result.step}); load with "
                   f"transformers.AutoModelForCausalLM.from_pretrained({str(result.out_dir)!r})", jsonable(result))


def cmd_figures(args) -> Summary:
    from stages.figures import FiguresConfig, FiguresInputs, FiguresOutputs, run_figures

    config = FiguresConfig(only=tuple(args.only) if args.only else None, skip_damaged=args.skip_damaged)
    check_writable(args.out)  # the directory named, not the first file drawn into it
    result = run_figures(config, FiguresInputs(store=args.store), FiguresOutputs(out_dir=args.out))
    # One figure's path a line (for `xargs`); a file drawn as a note because its data is absent
    # is not a figure: it is named apart, with why, and not among them.
    for path in result.paths:
        if path.name in result.skipped:
            print(f"{path}: a note, not a figure: {result.skipped[path.name]}", file=sys.stderr)
    drawn = [path for path in result.paths if path.name not in result.skipped]
    return Summary("\n".join(map(str, drawn)), jsonable(result))


def cmd_reference(args) -> Summary:
    from stages.reference import ReferenceConfig, ReferenceInputs, ReferenceOutputs, run_reference

    result = run_reference(ReferenceConfig(), ReferenceInputs(file=args.file), ReferenceOutputs(store=args.store))
    return Summary(f"{args.store}: run {result.run_id}, {result.points} checkpoint(s)", jsonable(result))


def cmd_report(args) -> Summary:
    from stages.report import ReportConfig, ReportInputs, ReportOutputs, run_report

    check_file_output(args.out, "--out", "report.md", inputs=[("--store", args.store)],
                      ours=is_report)
    result = run_report(ReportConfig(skip_damaged=args.skip_damaged),
                        ReportInputs(store=args.store, figures_dir=args.figures),
                        ReportOutputs(report=args.out))
    return Summary(f"{result.report}: {len(result.runs)} run(s)", jsonable(result))


def cmd_window_order(args) -> Summary:
    from optimus_core.data.window_order import write_order
    from optimus_core.data.windows import FileWindows

    if args.epochs < 1:
        raise ConfigError(f"--epochs = {args.epochs}: must be >= 1")
    if args.launcher == "parsl":  # the same command as a one-node job of the site (workflow/launch.py)
        from optimus_core.data.shards import load_manifest
        from workflow.launch import window_order_on_site

        load_manifest(args.data)  # tokens the job can read: checked here, before anything is submitted
        return _site_summary(window_order_on_site(vars(args)), args, f"window order drawn on site {args.site}")
    windows = FileWindows(args.data, "train", args.seq_len)
    paths = [write_order(windows, args.seed, epoch) for epoch in range(args.epochs)]
    lines = [f"{p} ({p.stat().st_size / 2**20:,.1f} MiB)" for p in paths]
    return Summary(f"the order of {len(windows):,} windows of {args.seq_len} tokens, seed {args.seed}:\n"
                   + "\n".join(lines), {"windows": len(windows), "paths": [str(p) for p in paths]})


def cmd_hosts(args) -> Summary:
    from workflow.hostfile import write_hostfile

    hosts = write_hostfile(args.out, nodes=args.nodes, faults=args.faults, nodefile=args.nodefile,
                           log=lambda line: print(line, file=sys.stderr))
    return Summary(f"{args.out}: {len(hosts)} host(s)", {"hostfile": str(args.out), "hosts": hosts})


def cmd_task_data(args) -> Summary:
    """`optimus task-data`: lm-eval's tasks loaded once where there is internet (a login node),
    their data left in the datasets cache the evaluation jobs read offline."""
    try:
        from optimus_core.eval.tasks import fetch_task_data
    except ImportError as e:
        raise ValueError(f"task-data needs lm-evaluation-harness ({e}); install the eval extra: "
                         f"pip install -e '.[eval]'") from None
    cache = os.environ.get("HF_DATASETS_CACHE") or "the default Hugging Face datasets cache"
    counts = fetch_task_data(args.tasks, task_dirs=args.task_dir or ())
    lines = [f"  {task}: {n:,} documents" for task, n in counts.items()]
    return Summary(f"{len(counts)} task(s) cached in {cache}:\n" + "\n".join(lines),
                   {"cache": cache, "documents": counts})


def cmd_warm_cache(args) -> Summary:
    from workflow.launch import warm_cache_on_site

    if args.steps < 1:
        raise ConfigError(f"--steps = {args.steps}: must be >= 1")
    done = warm_cache_on_site(vars(args))
    return _site_summary(done, args, f"compile cache of site {args.site} filled")


def cmd_presets(args) -> Summary:
    from optimus_core import presets

    if args.seq_len is not None and args.seq_len < 1:
        raise ConfigError(f"--seq-len = {args.seq_len}: must be >= 1")
    rows = []
    for name in presets.names():
        p = presets.get(name)
        m = p.model
        rows.append({"preset": name, "base": p.base, "tag": p.tag, "layers": m.n_layers, "d_model": m.d_model,
                     "heads": m.n_heads,
                     "experts": m.moe.n_experts if m.moe else None, "top_k": m.moe.top_k if m.moe else None,
                     "params": m.num_params(), "active_params": m.num_active_params(),
                     "flops_per_token": m.flops_per_token(args.seq_len or p.seq_len)})
    return Summary(presets_table(args.seq_len), {"presets": rows})


def presets_table(seq_len: int | None = None) -> str:
    from optimus_core import presets

    head = (f"{'preset':24s} {'base--tag':49s} {'layers':>6s} {'width':>6s} {'heads':>5s} {'experts':>7s} "
            f"{'top-k':>5s} {'total':>9s} {'active':>9s} {'GFLOP/tok':>10s}")
    lines = [head, "-" * len(head)]
    for name in presets.names():
        p = presets.get(name)
        m = p.model
        flops = m.flops_per_token(seq_len or p.seq_len) / 1e9
        tagged = f"{p.base}--{p.tag}" if p.tag else p.base
        lines.append(f"{name:24s} {tagged:49s} {m.n_layers:6d} {m.d_model:6d} {m.n_heads:5d} "
                     f"{m.moe.n_experts if m.moe else '-':>7} {m.moe.top_k if m.moe else '-':>5} "
                     f"{_human(m.num_params()):>9s} {_human(m.num_active_params()):>9s} {flops:10.3f}")
    lines.append("Any base with an authors' scaling tag is a preset too, e.g. olmoe-1b-7b--SE1.125 "
                 f"(bases: {', '.join(presets.BASES)}; tag keys: optimus_core/tags.py).")
    return "\n".join(lines)


def _human(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(n)


def cmd_experiments(args) -> Summary:
    from workflow.experiments import EXPERIMENTS

    return Summary("\n".join(exp.describe() for exp in EXPERIMENTS.values()),
                   {"experiments": [{"name": exp.name, "description": exp.describe()} for exp in EXPERIMENTS.values()]})


def cmd_plan(args) -> Summary:
    """The paper-scale jobs on a site: tiles, nodes, queue, walltime, estimated node-hours, total."""
    from workflow.experiments import dag, get as get_experiment
    from workflow.plan import plan_table
    from workflow.sites import load_site

    site = load_site(args.site)
    experiments = [get_experiment(n) for n in args.experiments] if args.experiments else dag("paper")
    table, plans = plan_table(experiments, site, _layout(args))
    jobs = [{"run": exp.name, **jsonable(job), "walltime": job.walltime, "node_hours": job.node_hours,
             "launcher": job.launcher, "pbs": job.pbs_lines()} for exp, job in zip(experiments, plans)]
    if args.pbs:
        table += "".join(f"\n\n# {exp.name}\n" + "\n".join(job.pbs_lines()) + f"\n{job.launcher} optimus pretrain ..."
                         for exp, job in zip(experiments, plans))
    if args.store:
        from workflow.plan import record_plan

        run_id = record_plan(args.store, site, experiments, plans, _layout(args))
        table += f"\n{args.store}: run {run_id} (the report's table of the paper's runs)"
    return Summary(table, {"site": site.name, "jobs": jobs, "node_hours": sum(job.node_hours for job in plans)})


def parse_checkpointing(text: str) -> tuple[str, int]:
    """``none``, ``moe``, ``full``, ``full/K`` (every K-th block) or ``level1`` .. ``level7`` as
    (mode, every)."""
    from optimus_core.flops import RECOMPUTE_LEVELS

    mode, _, every = text.partition("/")
    if mode not in ("none", "moe", "full", *RECOMPUTE_LEVELS) or (
            every and (mode != "full" or not every.isdigit() or int(every) < 1)):
        raise ConfigError(f"--checkpointing {text}: must be none, moe, full, full/K (every K-th block, K >= 1) or "
                          f"level1 .. level7 (the authors' recompute levels)")
    return mode, int(every or 1)


def rehearsal_jobs(names, tiles, site, checkpointing: tuple[str, int] | None = None, layout: str = "authors",
                   weight_gathers: str | None = None, sets: dict | None = None):
    """The registry's paper runs (``names``; default every run of the paper DAG) in design
    ``layout`` (workflow.experiments.DESIGNS) as rehearsals, each at its own tile count or at
    each of ``tiles``, with the config overrides ``sets`` (`--set`: a layout the registry does not
    run), its checkpointing and weight gathers resolved for the site's machine as `optimus plan`
    resolves them (workflow.plan.plan_memory), or ``checkpointing`` (mode, every) and
    ``weight_gathers`` where given: a choice rehearsed before the plan makes it."""
    from stages.rehearse import Rehearsal
    from workflow.experiments import dag, get as get_experiment
    from workflow.plan import plan_memory

    experiments = [get_experiment(n) for n in names] if names else dag("paper")
    jobs = []
    for exp in experiments:
        paper = exp.scale("paper", layout)
        for n in tiles or [paper.devices]:
            run = paper.at_tiles(n)
            if sets:
                run = dataclasses.replace(run, extra={**run.extra, **sets})
            _, budget, resolved, gathers = plan_memory(run, site, n)  # MemoryBudgetError: over the budget
            jobs.append(Rehearsal(exp.name, run.run_config(), n, checkpointing or resolved or ("none", 1),
                                  budget if budget == budget else None,
                                  (weight_gathers or gathers) if gathers else None))  # (None: not sharded)
    return jobs


def cmd_rehearse(args) -> Summary:
    from stages.rehearse import RehearseConfig, RehearseOutputs, ingest, run_rehearse
    from workflow.sites import load_site

    if args.ingest:
        if not args.store:
            raise ConfigError("--ingest needs --store")
        return Summary(ingest(args.ingest, args.store), {"ingested": args.ingest, "store": args.store})
    if any(n < 1 for n in args.tiles):
        raise ConfigError(f"--tiles {' '.join(map(str, args.tiles))}: tile counts must be >= 1")
    check_file_output(args.jsonl, "--jsonl", "rehearsal.jsonl", inputs=[("--store", args.store)],
                      ours=json_with("name", "world", "rank"))
    if args.device in ("cuda", "xpu"):
        from optimus_core.device import resolve_device_type

        # not here: one sentence, before any layout is built, naming what rehearse takes instead
        resolve_device_type(args.device, field="--device", instead="cpu (or meta: the shares' sizes only)")
    asked = parse_checkpointing(args.checkpointing) if args.checkpointing else None
    jobs = rehearsal_jobs(args.experiment, args.tiles, load_site(args.site, account=args.site_account), asked,
                          _layout(args), args.weight_gathers, parse_overrides(args.set))
    result = run_rehearse(RehearseConfig(jobs, rank=args.rank, steps=args.steps, device=args.device,
                                         micro_batches=args.micro_batches or None, save=not args.no_save),
                          RehearseOutputs(jsonl=args.jsonl, store=args.store))
    done = f"{len(result.records)} rehearsal(s)" + (f", written to {args.jsonl}" if args.jsonl else "")
    if args.store:
        done += f"; wrote run {result.run_id} to {args.store}"
    return Summary(done, jsonable(result))


def cmd_scaling(args) -> Summary:
    from stages.scaling import ScalingConfig, ScalingOutputs, format_table, parse_setting, run_scaling

    bad = [e for e in args.ep if e != "all" and not e.lstrip("-").isdigit()]
    if bad:
        raise ConfigError(f"scaling.ep = {bad[0]!r}: must be 'all' or an integer >= 1")
    check_file_output(args.jsonl, "--jsonl", "scaling.jsonl", inputs=[("--store", args.store)],
                      ours=json_with("run_id", "step_s"))
    eps = tuple(e if e == "all" else int(e) for e in args.ep)
    config = ScalingConfig(preset=args.preset, devices=tuple(args.devices), ep=eps if len(eps) > 1 else eps[0],
                           optimizer=args.optimizer, global_batch=args.global_batch, micro_batch=args.micro_batch,
                           fitted=tuple(parse_setting(f, "fitted") for f in args.fitted),
                           holdout=tuple(parse_setting(h) for h in args.holdout), steps=args.steps,
                           warmup=args.warmup, rounds=args.rounds, retries=args.retries,
                           max_cpu_wait=args.max_cpu_wait, device=args.device, threads_per_rank=args.threads,
                           overrides=parse_overrides(args.set), run_id=args.run_id or "")
    result = run_scaling(config, ScalingOutputs(store=args.store, jsonl=args.jsonl))
    return Summary(f"{result.run_id}\n{format_table(result.points)}", jsonable(result))


def cmd_perfmodel(args) -> Summary:
    from workflow.scaling_study import check_paths, run_study

    check_paths(args.measured)
    check_file_output(args.out, "--out", "perfmodel.json",
                      inputs=[("--store", args.store), *(("--measured", m) for m in args.measured)],
                      ours=json_with("holdout", "paper"))
    if args.store and not Path(args.store).exists() and not args.measured:
        raise FileNotFoundError(f"no results store at {args.store} and no --measured files: nothing to calibrate "
                                f"on (run `optimus scaling --store {args.store}` first, or check the path)")
    study = run_study(args.store, args.measured, out_json=args.out)
    lines = [f"held out: {h['sweep']} at {h['devices']} devices: measured {h['measured_s']:.4g} s, "
             f"predicted {h['predicted_s']:.4g} s ({h['rel_error']:+.1%}, fitted on {h['fitted_on']} points)"
             for h in study["holdout"]]
    lines += [f"skipped: {name}: {why}" for name, why in study["skipped"].items()]
    paper = study["paper"]
    lines.append(f"paper sweep on {paper['machine']}: efficiency at {paper['tiles'][-1]} tiles "
                 f"{paper['efficiency'][-1]:.1%} in the authors' layout (overlap grad_sync what-if: "
                 f"{paper['efficiency_overlap_grad_sync'][-1]:.1%}; our zero3-blocks design: "
                 f"{paper['efficiency_zero3_blocks'][-1]:.1%})")
    if args.out:
        lines.append(str(args.out))
    return Summary("\n".join(lines), jsonable(study))


def cmd_execution(args) -> Summary:
    """How a run would execute: its execution plan on ``--world`` ranks of ``--device``, every
    choice with its reason. A device of this machine is probed (its kernels self-checked), as
    the run would; one that is not here is planned from its type alone."""
    from optimus_core import presets
    from optimus_core.device import resolve_device_type
    from optimus_core.execution import plan_execution
    from optimus_core.memory import GIB

    if bool(args.preset) == bool(args.experiment):
        raise ConfigError("execution needs --preset NAME or --experiment NAME (one of them)")
    if args.world is not None and args.world < 1:
        raise ConfigError(f"--world = {args.world}: must be >= 1")
    overrides = {}
    if args.experiment:
        from workflow.experiments import get as get_experiment

        scale = get_experiment(args.experiment).scale(args.scale, _layout(args))
        preset_name, overrides, world = scale.preset, dict(scale.overrides()), scale.devices
    else:
        preset_name, world = args.preset, 1
    world = args.world or world
    overrides.update(parse_overrides(args.set))
    cfg = presets.get(preset_name).run_config(**overrides)
    here = resolve_device_type("auto")
    device = here if args.device == "auto" else args.device
    if device not in ("cpu", "cuda", "xpu"):
        raise ConfigError(f"--device {device}: must be auto, cpu, cuda or xpu")
    probe = device == here
    # the budget of execution.memory_budget_gib where set (what auto's recomputation and weight
    # gathers are resolved against), else none: the device is often not here to ask
    budget = cfg.execution.memory_budget_gib * GIB if cfg.execution.memory_budget_gib else None
    plan = plan_execution(cfg, device, world, budget_bytes=budget, probe=probe)
    where = f"{world} rank(s) of {device}" + ("" if probe else " (not on this machine: planned from its type)")
    return Summary(f"{cfg.preset or preset_name} on {where}:\n{plan.describe()}",
                   jsonable({"preset": cfg.preset or preset_name, "device": device, "world": world, "probed": probe,
                             "plan": plan.to_dict()}))
