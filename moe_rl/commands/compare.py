"""``moe-rl compare --config configs/compare/demo.yaml``: several runs with the same
seed and data (each a ``moe-rl train`` process), their TensorBoard events under one
directory (so TensorBoard overlays them), and ``report.md`` with plots."""

from __future__ import annotations

import argparse
import copy
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HELP = "run several algorithms on the same data and write a comparison report"


def add_parser(sub: argparse._SubParsersAction) -> None:
    add_arguments(sub.add_parser("compare", help=HELP, description=HELP))


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``compare``'s options (``demo`` takes them too)."""
    p.add_argument(
        "--config",
        default="configs/compare/demo.yaml",
        help="the comparison: a base config and the runs (default: %(default)s, from the repository root)",
    )
    p.add_argument("--only", default=None, help="comma-separated runs to do (names from the config)")
    p.add_argument(
        "--seeds", default=None, help="comma-separated seeds: every run once per seed, reported as mean and spread"
    )
    p.add_argument(
        "--fresh",
        action="store_true",
        help="delete the earlier results of the runs being done (their directories under out_dir) and start them over",
    )
    p.add_argument("overrides", nargs="*", help="key=value overrides applied to every run (base config keys)")
    p.set_defaults(func=run)


def _merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def run(args: argparse.Namespace) -> int:
    import yaml

    from moe_rl.commands._distributed import fail
    from moe_rl.config import ConfigError, ConfigLoader, load_config, yaml_problem

    try:
        spec = yaml.load(Path(args.config).read_text(), Loader=ConfigLoader)
    except yaml.YAMLError as e:
        return fail(f"cannot read compare config {args.config!r}: {yaml_problem(e)}")
    except (OSError, UnicodeDecodeError) as e:
        return fail(f"cannot read compare config {args.config!r}: {str(e).splitlines()[0]}")
    problem = _shape_problem(spec)
    if problem:
        return fail(f"compare config {args.config}: {problem}")
    try:
        seeds = [int(x) for x in (args.seeds or "").split(",") if x.strip()]
    except ValueError:
        return fail(f"--seeds {args.seeds!r} must be comma-separated integers")
    out_dir = Path(spec.get("out_dir", "runs/compare"))
    runs = spec.get("runs") or {}
    only = [x for x in (args.only or "").split(",") if x]
    if only:
        missing = set(only) - set(runs)
        if missing:
            return fail(f"--only names unknown runs {sorted(missing)}; runs: {', '.join(runs)}")
        runs = {k: v for k, v in runs.items() if k in only}
    if seeds:
        runs = seeded_runs(runs, seeds, spec.get("more_seeds") or {})
    busy = runs_in_use(out_dir, list(runs))
    if busy:
        return fail(f"{busy}: another compare or train is running there (nothing was started or deleted)")
    earlier = earlier_runs(out_dir, list(runs)) if args.fresh else []  # (before this compare writes configs)
    checked = {}
    with tempfile.TemporaryDirectory() as scratch:  # every run's config checked before any is written
        for name, extra in runs.items():
            merged = _merge(spec.get("base") or {}, extra or {})
            merged.setdefault("train", {})["run_dir"] = str(out_dir / name)
            text = yaml.safe_dump(merged, sort_keys=False)
            trial = Path(scratch) / f"{name}.yaml"
            trial.write_text(text)
            try:
                checked[name] = (text, load_config(str(trial), args.overrides))
            except ConfigError as e:
                return fail(f"run {name!r}: {e}")
    if not checked:
        return fail("no runs to compare")
    configs = {}
    for name, (text, cfg) in checked.items():
        path = out_dir / "configs" / f"{name}.yaml"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        configs[name] = (path, cfg)
    for run_dir in remove_runs(earlier):  # once every run's config is known good
        print(f"[compare] --fresh: deleted the earlier run {run_dir}", flush=True)

    start = time.monotonic()
    first = next(iter(configs.values()))
    print(
        f"[compare] preparing the model ({first[1].model.hf_dir or 'built-in demo model, cached after the first time'})",
        flush=True,
    )
    code = _moe_rl(
        ["prepare", "--config", str(first[0]), *args.overrides], out_dir / "prepare.log", threads=os.cpu_count() or 1
    )
    if code != 0:
        return fail(f"preparing the model failed; see {out_dir / 'prepare.log'}")
    parallel = runs_at_a_time(spec, [cfg for _, cfg in configs.values()])
    threads = max(1, (os.cpu_count() or 1) // parallel)
    pending = list(configs.items())
    active: list[tuple[str, subprocess.Popen, float]] = []
    failed = []
    while pending or active:
        while pending and len(active) < parallel:
            name, (path, cfg) = pending.pop(0)
            log_path = Path(cfg.train.run_dir) / "train.log"
            if finished_earlier(cfg):
                print(f"[compare] {name}: {start_line(Path(cfg.train.run_dir), cfg.train.steps)}", flush=True)
                continue
            log_path.parent.mkdir(parents=True, exist_ok=True)
            proc = _start(["train", "--config", str(path), *args.overrides], log_path, threads)
            active.append((name, proc, time.monotonic()))
            print(
                f"[compare] {name}: {start_line(Path(cfg.train.run_dir), cfg.train.steps)} (log: {log_path})",
                flush=True,
            )
        time.sleep(0.5)
        for item in list(active):
            name, proc, t0 = item
            if proc.poll() is not None:
                active.remove(item)
                status = "done" if proc.returncode == 0 else f"FAILED (exit {proc.returncode})"
                print(f"[compare] {name}: {status} in {time.monotonic() - t0:.0f}s", flush=True)
                if proc.returncode != 0:
                    failed.append(name)
    from moe_rl.claims import CLAIM_SETS, claims_lead, claims_section, evaluate_claims, replay_answer, summary_line
    from moe_rl.report import read_scalars, regime_section, write_report

    done = {
        name: read_scalars(Path(cfg.train.run_dir), up_to=cfg.train.steps)
        for name, (_, cfg) in configs.items()
        if name not in failed
    }
    compared = set(spec.get("runs") or {}) if not only else set(only)
    claims = evaluate_claims(done, seeds=seeds, compared=compared, claims=CLAIM_SETS[spec.get("claims", "papers")])
    report = write_report(
        out_dir,
        done,
        list(spec.get("fixed_steps", [])),
        extra_sections="\n\n".join(x for x in (regime_section(done, seeds), claims_section(claims, seeds)) if x),
        seeds=seeds,
        lead=replay_answer(done, seeds) + claims_lead(claims),
    )
    print(
        f"[compare] {len(done)}/{len(configs)} runs in {time.monotonic() - start:.0f}s; {summary_line(claims)}; report: {report}"
    )
    print(f"[compare] tensorboard --logdir {out_dir}")
    return 1 if failed else 0


def seeded_runs(runs: dict, seeds: list[int], more: dict[str, list[int]]) -> dict:
    """Every run once per seed (``<name>_s<seed>``, ``train.seed`` set), and the runs named in
    ``more`` (a compare config's ``more_seeds``) with those seeds as well: more pairs for the
    claims that hinge on them."""
    return {
        f"{name}_s{seed}": _merge(extra or {}, {"train": {"seed": seed}})
        for name, extra in runs.items()
        for seed in seeds + [s for s in more.get(name, []) if s not in seeds]
    }


def start_line(run_dir: Path, steps: int) -> str:
    """How a run starts: afresh, or continuing the checkpoints an earlier compare left
    (said out loud: a finished run is reused as it is, results of older code included)."""
    from moe_rl.checkpoint.catalog import latest_checkpoint

    newest = latest_checkpoint(run_dir)
    if newest is None:
        return "started"
    how = "already finished: its results are reused" if newest[0] >= steps else "continuing it"
    return f"{run_dir} holds an earlier run up to step {newest[0]}, {how} (--fresh starts it over)"


def finished_earlier(cfg) -> bool:
    """Whether ``cfg``'s run directory holds a finished run of the same config (its
    fingerprint), whose results are then reused without starting it; a run of another
    config is left to ``moe-rl train`` to refuse."""
    from moe_rl.checkpoint.run_dir import check_run_dir
    from moe_rl.checkpoint.catalog import latest_checkpoint
    from moe_rl.config import ConfigError

    newest = latest_checkpoint(cfg.train.run_dir)
    if newest is None or newest[0] < cfg.train.steps:
        return False
    try:
        check_run_dir(cfg)
    except ConfigError:
        return False
    return True


def runs_in_use(out_dir: Path, names: list[str]) -> str | None:
    """The first of ``names``' run directories a live run holds, said in one line, or ``None``."""
    from moe_rl.checkpoint.run_dir import holder_of, in_use_message

    for name in names:
        holder = holder_of(out_dir / name)
        if holder is not None:
            return f"run {name!r}: {in_use_message(out_dir / name, holder)}"
    return None


def earlier_runs(out_dir: Path, names: list[str]) -> list[Path]:
    """The run directories an earlier compare made for ``names`` (the ones whose config it
    wrote under ``out_dir/configs``); nothing else."""
    return [
        out_dir / name
        for name in names
        if (out_dir / name).is_dir() and (out_dir / "configs" / f"{name}.yaml").is_file()
    ]


def remove_runs(run_dirs: list[Path]) -> list[Path]:
    """Delete ``run_dirs`` (:func:`earlier_runs`); the ones deleted."""
    import shutil

    for run_dir in run_dirs:
        shutil.rmtree(run_dir)
    return run_dirs


def runs_at_a_time(spec: dict, configs: list) -> int:
    """``parallel_runs``, except that runs on SGLang servers go one at a time: each run
    syncs its own weights into the servers it uses (and a launched server takes a fixed
    port), so two at once would sample from each other's weights."""
    parallel = max(1, int(spec.get("parallel_runs", 1)))
    if parallel > 1 and any(cfg.rollout.engine == "sglang" for cfg in configs):
        print(
            "[compare] the runs use SGLang servers: they run one at a time (each syncs its own weights into them)",
            flush=True,
        )
        return 1
    return parallel


def _shape_problem(spec) -> str | None:
    """What is wrong with the compare config's shape, in one line (``None``: nothing)."""
    if not isinstance(spec, dict):
        return "must hold a mapping with base, runs, out_dir, parallel_runs, fixed_steps"
    unknown = set(spec) - {"out_dir", "parallel_runs", "fixed_steps", "base", "runs", "claims", "more_seeds"}
    if unknown:
        return (
            f"unknown key {sorted(unknown)[0]!r}; valid: base, runs, out_dir, parallel_runs, fixed_steps, claims, "
            "more_seeds"
        )
    from moe_rl.claims import CLAIM_SETS

    if spec.get("claims", "papers") not in CLAIM_SETS:
        return f"claims={spec.get('claims')!r} must be one of {', '.join(CLAIM_SETS)}"
    if not isinstance(spec.get("base") or {}, dict):
        return "base must be a mapping (a `moe-rl train` config)"
    runs = spec.get("runs") or {}
    if not isinstance(runs, dict) or any(not isinstance(v or {}, dict) for v in runs.values()):
        return "runs must map each run name to a mapping of overrides (or nothing)"
    more = spec.get("more_seeds") or {}
    if not isinstance(more, dict) or any(
        name not in runs
        or not isinstance(s, list)
        or not all(isinstance(x, int) and not isinstance(x, bool) for x in s)
        for name, s in more.items()
    ):
        return "more_seeds must map run names (of runs) to lists of integer seeds"
    parallel = spec.get("parallel_runs", 1)
    if isinstance(parallel, bool) or not isinstance(parallel, int) or parallel < 1:
        return f"parallel_runs={parallel!r} must be an integer >= 1"
    steps = spec.get("fixed_steps", [])
    if not isinstance(steps, list) or any(isinstance(x, bool) or not isinstance(x, int) for x in steps):
        return f"fixed_steps={steps!r} must be a list of step numbers"
    if not isinstance(spec.get("out_dir", ""), str):
        return "out_dir must be a path"
    return None


def _start(argv: list[str], log_path: Path, threads: int) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONWARNINGS": "ignore"}
    log = open(log_path, "w")
    return subprocess.Popen([sys.executable, "-m", "moe_rl.cli", *argv], stdout=log, stderr=subprocess.STDOUT, env=env)


def _moe_rl(argv: list[str], log_path: Path, threads: int) -> int:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    return _start(argv, log_path, threads).wait()
