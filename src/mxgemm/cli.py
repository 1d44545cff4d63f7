"""Command line: ``mxgemm info`` and ``mxgemm bench`` (also ``python -m mxgemm``)."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shlex
import signal
import sys
from collections.abc import Sequence

import torch
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from . import settings, thresholds
from .backends import AUTO_PRIORITY, get_backend
from .backends.base import tactic_json
from .backends.capabilities import GroupedWeights
from .bench import (
    BASELINES,
    CPU_M,
    CPU_SHAPES,
    DEFAULT_M,
    MODELS,
    bench_record,
    markdown_table,
    parse_shapes,
    run_bench,
    table_rows,
)
from .bench_moe import MOE_MODELS
from .device import describe_device
from .errors import MXGemmError
from .moe import GRAPHED_TOKENS
from .resolve import available_backends, default_request, explain_auto

__all__ = ["main"]


def _info(console: Console) -> int:
    device = describe_device()
    from .bench import environment

    env = environment(device)
    console.print(f"[bold]device[/bold]: {device}")
    console.print("versions: " + ", ".join(f"{k} {env[k]}" for k in ("mxgemm", "torch", "triton", "cuda", "python")))
    table = Table(title="backends")
    for col in ("backend", "available", "recipes", "grouped (MoE)", "tunable", "reason"):
        table.add_column(col)
    for row in available_backends(device):
        backend = get_backend(row.name)
        tunable = "yes" if backend.tunable else "no"
        grouped = ", ".join(backend.grouped_recipes) if isinstance(backend, GroupedWeights) else "no"
        table.add_row(
            row.name, "yes" if row.available else "no", ", ".join(row.recipes), grouped, tunable, escape(row.reason)
        )
    console.print(table)
    console.print(f"auto priority: {' > '.join(AUTO_PRIORITY)}")
    for label, grouped in (("", False), (" for grouped weights (MoE experts)", True)):
        try:
            res = explain_auto(device, grouped=grouped)
        except MXGemmError as exc:
            console.print(f"[bold]auto[/bold]{label}: {escape(str(exc))}")
            continue
        console.print(f"[bold]auto[/bold]{label} resolves to: {res.backend.name} ({res.recipe})")
        for name, reason in res.skipped:
            console.print(f"  skipped {name}: {escape(reason)}")
    for line in settings.problems():
        console.print(f"[yellow]warning:[/yellow] {escape(line)}")
    try:
        console.print(f"default request (MXGEMM_BACKEND): {default_request()}")
    except MXGemmError as exc:
        console.print(f"[yellow]warning:[/yellow] {escape(str(exc))}")
    if device.type == "cuda":
        from .fastcall import status

        console.print(f"eager calls: {escape(status().reason)}")
    else:
        console.print("eager calls: the Python path (C++ calls the CUDA kernels' plans, on a GPU)")
    try:
        graphs = "on (MXGEMM_EAGER_GRAPHS=0 turns them off)" if settings.eager_graphs_enabled() else "off"
    except MXGemmError:  # said among the warnings above
        graphs = "MXGEMM_EAGER_GRAPHS is not a switch"
    console.print(f"MoE blocks' and experts' eager graphs (up to {GRAPHED_TOKENS} tokens): {graphs}")
    limits = thresholds.for_sm(device.sm)
    unmeasured = device.type == "cuda" and device.sm not in thresholds.MEASURED
    console.print(
        f"route thresholds: measured on {limits.measured_on}"
        + (f"; SM{device.sm} has no table of its own and takes SM90's" if unmeasured else "")
    )
    from .autotune import Autotuner

    tuner = Autotuner.for_device(device)
    console.print(f"tuning file (this GPU and environment): {escape(tuner.cache.describe())}")
    shipped = tuner.shipped.describe() if tuner.shipped else "none for this GPU"
    console.print(f"shipped tuning file: {escape(shipped)}")
    return 0


def _bench_moe(args: argparse.Namespace, console: Console) -> int:
    from .bench_moe import MOE_MODELS, bench_record, markdown_table, run_moe_bench, table_rows

    if describe_device().type != "cuda":
        console.print(
            "[yellow]no CUDA GPU: timing tiny experts on CPU against bf16 torch._grouped_mm; a smoke run, not a "
            "measure of GPU speed (the models and --m are ignored)[/yellow]"
        )
    env, rows = run_moe_bench(args.moe or list(MOE_MODELS), args.m, progress=lambda s: console.print(f"[dim]{s}[/dim]"))
    command = _command(args)
    _show_table(console, f"mxgemm bench --moe on {env['name']}", *table_rows(rows))
    _save(args, bench_record(env, rows, command), f"Command: `{command}`\n\nDevice: {env}\n\n{markdown_table(rows)}")
    return 0


def _command(args: argparse.Namespace) -> str:
    return "mxgemm " + " ".join(shlex.quote(a) for a in args.argv)


def _show_table(console: Console, title: str, header: list[str], cells) -> None:
    """The bench table on screen."""
    table = Table(title=title)
    for h in header:
        table.add_column(h, justify="right")
    for row in cells:
        table.add_row(*row)
    console.print(table)


def _save(args: argparse.Namespace, record: dict, markdown: str) -> None:
    """``--json`` and ``--markdown``: the run's record and its table, where asked."""
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=1)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(markdown)


def _bench(args: argparse.Namespace, console: Console) -> int:
    if args.moe is not None:
        return _bench_moe(args, console)
    device = describe_device()
    if device.type != "cuda":
        console.print(
            "[yellow]no CUDA GPU: timing the emulation backend on small CPU shapes against bf16 F.linear; "
            "a smoke run, not a measure of GPU speed[/yellow]"
        )
        base = CPU_SHAPES
        ms = CPU_M
        if "--model" in args.argv or "--m" in args.argv:
            console.print("[yellow]--model and --m choose GPU shape sets: ignored here (--shapes runs yours)[/yellow]")
    else:
        base = [s for model in args.model for s in MODELS[model]]
        ms = args.m or DEFAULT_M
    if args.shapes:
        shapes = [(m, n, k, "custom") for m, n, k in parse_shapes(args.shapes)]
    else:
        shapes = [(m, n, k, name) for n, k, name in base for m in ms]
    env, rows = run_bench(
        shapes,
        backends=args.backends,
        baselines=args.baselines,
        progress=lambda s: console.print(f"[dim]{s}[/dim]"),
    )
    smoke = device.type != "cuda"
    _show_table(console, f"mxgemm bench on {env['name']}", *table_rows(rows, smoke=smoke, wide=args.wide))
    command = _command(args)
    markdown = f"Command: `{command}`\n\nDevice: {env}\n\n{markdown_table(rows, smoke=smoke)}"
    _save(args, bench_record(env, rows, command), markdown)
    if args.plot:
        from .bench import plot

        plot(rows, args.plot)
    return 0


def _hf_meta_model(model_dir: str, console: Console, command: str):
    """The model of a Hugging Face model folder built on the meta device (shapes only: no weights are read or
    allocated); None (error printed) without transformers."""
    if not _have_transformers(console, command):
        return None
    from transformers import AutoConfig

    from .models import hf_meta_model

    return hf_meta_model(AutoConfig.from_pretrained(model_dir))


def _have_transformers(console: Console, command: str) -> bool:
    """Whether transformers can be imported; if not, says so (with the install command)."""
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        hint = escape(f"`mxgemm {command}` reads models with transformers: pip install 'mxgemm[hf]'")
        console.print(f"[red]error:[/red] {hint}")
        return False
    return True


_WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json", "*.bin", "*.bin.index.json", "*.pt", "*.pth", "*.gguf")


def _quantize(args: argparse.Namespace, console: Console) -> int:
    """Quantize a Hugging Face model folder to a compressed-tensors MXFP8 checkpoint.

    Nothing of the user's is lost: the source must be a local model folder apart from the output; the output must
    be new or empty (``--force`` replaces it); the checkpoint is written into a temporary folder beside the output and
    moved into place only once complete. The source's other files and subfolders (tokenizer, a sentence-transformers
    ``1_Pooling/``, ...) are copied; its weight files and config are not (the checkpoint has its own)."""
    import shutil
    from pathlib import Path

    from rich.progress import Progress

    from .convert import quantize_folder
    from .model_folder import copy_side_files
    from .output_folder import move_into_place, remove_stale_staging, staging_folder

    src, out = Path(args.model_dir).resolve(), Path(args.out_dir).resolve()
    _check_quantize_paths(src, out, args.force)
    max_shard_bytes = _parse_size(args.max_shard_size)
    _check_device(args.device)
    if not _have_transformers(console, "quantize"):
        return 2
    for stale in remove_stale_staging(out):
        console.print(escape(f"removed {stale.name}, left beside the output by an interrupted run"))
    staging = staging_folder(out)
    try:
        with _terminate_as_interrupt():
            # side files first: the checkpoint's own files win over any of the same name
            copy_side_files(src, staging, lambda f: f.name == "config.json" or any(map(f.match, _WEIGHT_FILES)))
            with Progress(console=console, transient=True) as bar:
                task = bar.add_task("quantizing", total=None)
                report = quantize_folder(
                    src,
                    staging,
                    scheme=args.scheme,
                    scale_mode=args.scale_mode,
                    skip=tuple(getattr(args, "skip", ("lm_head",))),
                    skip_must_match=hasattr(args, "skip"),
                    device=args.device,
                    max_shard_bytes=max_shard_bytes,
                    progress=lambda nbytes, total: bar.update(task, total=total, advance=nbytes),
                )
            move_into_place(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    console.print(escape(str(report)))
    console.print(escape(f"wrote {args.scheme} compressed-tensors checkpoint to {args.out_dir}"))
    return 0


@contextlib.contextmanager
def _terminate_as_interrupt():
    """SIGTERM (a job's stop, ``kill``) raises KeyboardInterrupt while the body runs, so that its cleanup runs as on
    Ctrl-C; the handler before is restored after. Outside the main thread signals cannot be handled: nothing."""

    def interrupt(signum, frame):
        raise KeyboardInterrupt(f"signal {signum}")

    try:
        previous = signal.signal(signal.SIGTERM, interrupt)
    except ValueError:
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _check_device(name: str) -> None:
    """``--device``: a device torch knows and has here, or a one-line error."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"--device {name!r} is not a device (cpu, cuda, cuda:1)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: this torch ({torch.__version__}) sees no CUDA GPU; use --device cpu")


def _parse_size(text: str) -> int:
    """ "5GB", "500MB", "10KiB", "1000B" -> bytes; a number without a unit is refused (5 would be 5 bytes)."""
    units = {
        "B": 1,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "TB": 10**12,
        "KIB": 2**10,
        "MIB": 2**20,
        "GIB": 2**30,
        "TIB": 2**40,
    }
    number = text.strip().upper().rstrip("BIKMGT")
    unit = text.strip().upper()[len(number) :]
    try:
        value = float(number) * units[unit or "none"]
    except (ValueError, KeyError):
        raise ValueError(f"--max-shard-size {text!r}: give a size with its unit, such as 5GB, 500MB or 2GiB") from None
    if not (math.isfinite(value) and value >= 1):
        raise ValueError(f"--max-shard-size {text!r} must be a finite size of at least one byte")
    return int(value)


def _check_quantize_paths(src, out, force: bool) -> None:
    """Refuse what would lose data or could not work, each with a one-line reason."""
    if not src.is_dir():
        raise ValueError(f"no model folder at {src} (mxgemm quantize reads a local folder, never the model hub)")
    if not (src / "config.json").is_file():
        raise ValueError(f"{src} has no config.json: not a Hugging Face model folder")
    if out == src or out.is_relative_to(src) or src.is_relative_to(out):
        raise ValueError(f"output {out} must lie apart from the model folder {src}: neither inside the other")
    if out.exists() and not out.is_dir():
        raise ValueError(f"{out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise ValueError(f"{out} is not empty; choose a new folder, or pass --force to replace its contents")


def _tune(args: argparse.Namespace, console: Console) -> int:
    """Tune the resolved backend's tactics for a shape set on this device and write the cache."""
    from rich.progress import Progress

    from .autotune import Autotuner
    from .backends import get_backend
    from .bench import mx_weights
    from .tuning import BUCKETS, TuneKey, bucket
    from .weights import prepare_weight

    device = describe_device()
    if args.moe is not None:
        return _tune_moe(args, console, device, Autotuner.for_device(device))
    problems: dict[tuple[int, int], set[int]] = {}
    if args.shapes:
        for m, n, k in parse_shapes(args.shapes):
            problems.setdefault((n, k), set()).add(bucket(m))
    elif args.model_dir:
        from .models import linear_shapes

        model = _hf_meta_model(args.model_dir, console, "tune --model-dir")
        if model is None:
            return 2
        shapes = linear_shapes(model, skip=args.skip)
        console.print(f"{len(shapes)} distinct linear shapes in {args.model_dir}")
        for n, k, _ in shapes:
            problems.setdefault((n, k), set()).update(bucket(m) for m in (args.m or BUCKETS))
    else:
        for model in args.model:
            for n, k, _ in MODELS[model]:
                problems.setdefault((n, k), set()).update(bucket(m) for m in (args.m or BUCKETS))
    tuner = Autotuner.for_device(device)
    rows, skipped, cached = [], set(), 0
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("tuning", total=sum(len(v) for v in problems.values()))
        for (n, k), ms in problems.items():
            ((q, s),) = mx_weights(n, k, device.torch_device, 1)
            weight = prepare_weight(q, s)
            backend = get_backend(weight.backend)
            for m in sorted(ms):
                if not args.force and tuner.cache.get(TuneKey.of(backend.name, weight, m, torch.bfloat16)):
                    cached += 1
                    progress.advance(task)
                    continue
                result = tuner.tune(backend, weight, m, torch.bfloat16)
                if result is None:
                    skipped.add(backend.name)
                else:
                    rows.append((m, n, k, backend.name, result))
                progress.advance(task)
    _tuned_table(console, device, tuner, rows, skipped, cached, "M")
    return 0


def _tune_moe(args: argparse.Namespace, console: Console, device, tuner) -> int:
    """Tune the grouped weights of the experts of ``--moe`` models (random MX experts on this device) at ``--m``
    tokens (their top-k copies sorted by expert, keyed by rows per expert and active experts), and gate/up's tactic in
    their routed block (timed on the whole block)."""
    from .backends import get_backend
    from .bench_moe import MOE_MODELS, MOE_TOKENS, random_experts
    from .grouped import prepare_grouped_weight
    from .tuning import TuneKey

    rows, skipped, cached = [], set(), 0
    probe = get_backend(prepare_grouped_weight(*random_experts(1, 32, 32, seed=0, device=device.torch_device)).backend)
    if not probe.tunable:  # before any expert of size is made
        _tuned_table(console, device, tuner, rows, {probe.name}, cached, "tokens")
        return 0
    for model in args.moe or sorted(MOE_MODELS):
        e, hidden, width, topk = MOE_MODELS[model]
        gate_up, down = (
            prepare_grouped_weight(*random_experts(e, n, k, seed=n + k, device=device.torch_device))
            for n, k in ((2 * width, hidden), (hidden, width))
        )
        backend = get_backend(gate_up.backend)
        # each projection on its rows, then gate/up's tactic in the routed block, timed on the whole block
        for proj, weight, op in (
            ("gate_up", gate_up, "grouped"),
            ("down", down, "grouped"),
            ("block", gate_up, "experts"),
        ):
            n, k = weight.out_features, weight.in_features
            for tokens in args.m or MOE_TOKENS:
                key = TuneKey.grouped(backend.name, weight, tokens * topk, torch.bfloat16, op=op)
                if not args.force and tuner.cache.get(key):
                    cached += 1
                    continue
                if op == "experts":
                    result = tuner.tune_experts(backend, gate_up, down, tokens, topk, torch.bfloat16)
                else:
                    result = tuner.tune_grouped(backend, weight, tokens * topk, torch.bfloat16, topk=topk)
                if result is None:
                    skipped.add(backend.name)
                else:
                    rows.append((tokens, n, k, backend.name + (" (block)" if op == "experts" else ""), result))
                    console.print(
                        f"[dim]{model} {proj} [{e}, {n}, {k}] at {tokens} tokens: {result.best_us:.1f} µs[/dim]"
                    )
        del gate_up, down, weight
    _tuned_table(console, device, tuner, rows, skipped, cached, "tokens")
    return 0


def _tuned_table(console: Console, device, tuner, rows: list, skipped: set, cached: int, first: str) -> None:
    """What tuning did: the backends without tactics, the problems the cache had, a row per problem tuned."""
    if skipped:
        console.print(f"nothing to tune for {', '.join(sorted(skipped))}: no tactics (or capturing)")
    if cached:
        console.print(f"{cached} problems already tuned in {tuner.cache.path} (--force re-tunes them)")
    if rows:
        table = Table(title=f"tuned on {device} -> {tuner.cache.path}")
        for col in (first, "N", "K", "backend", "default µs", "tuned µs", "speedup", "failed", "tactic"):
            table.add_column(col, justify="right")
        for m, n, k, name, r in rows:
            tactic = "default" if r.is_default else json.dumps(tactic_json(r.tactic), separators=(",", ":"))
            table.add_row(
                str(m),
                str(n),
                str(k),
                name,
                f"{r.default_us:.1f}",
                f"{r.best_us:.1f}",
                f"{r.speedup:.2f}",
                str(r.failed),
                tactic,
            )
        console.print(table)


def _parser() -> argparse.ArgumentParser:
    from .version import __version__

    defaults = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(prog="mxgemm", description="MXFP8 GEMMs for PyTorch", formatter_class=defaults)
    parser.add_argument("--version", action="version", version=f"mxgemm {__version__}")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error, not only its line")
    sub = parser.add_subparsers(dest="command", metavar="{info,bench,quantize,tune}")

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help, formatter_class=defaults)

    command("info", "device, versions, every backend: available or not and why, what auto picks")
    bench = command("bench", "time the available backends against bf16 on a shape set")
    bench.add_argument("--model", nargs="+", choices=sorted(MODELS), default=["llama3-8b"], help="shape sets")
    bench.add_argument("--m", type=int, nargs="+", help=f"token counts (default {' '.join(map(str, DEFAULT_M))})")
    bench.add_argument("--shapes", help="explicit shapes MxNxK,MxNxK (overrides --model/--m)")
    bench.add_argument(
        "--moe",
        nargs="*",
        choices=sorted(MOE_MODELS),
        metavar="MODEL",
        help=f"time the grouped GEMMs of these models' experts instead ({', '.join(MOE_MODELS)}; none named: all), "
        "--m their token counts",
    )
    bench.add_argument("--backends", nargs="+", help="backends to time (default: every available one)")
    bench.add_argument("--wide", action="store_true", help="every column on screen (the files always have them)")
    bench.add_argument("--json", help="write the rows as JSON here")
    bench.add_argument("--markdown", help="write a Markdown table here")
    bench.add_argument("--plot", help="write a PNG plot of speedups over bf16 here (needs matplotlib)")
    bench.add_argument(
        "--baselines", nargs="*", default=list(BASELINES), choices=list(BASELINES), help="baselines besides mxgemm"
    )
    quant = command("quantize", "write a compressed-tensors MXFP8 checkpoint of a Hugging Face model")
    quant.add_argument("model_dir", help="a model folder (config.json + safetensors)")
    quant.add_argument("out_dir", help="where to write the MXFP8 checkpoint")
    quant.add_argument("--scheme", choices=["MXFP8", "MXFP8A16"], default="MXFP8", help="activation scheme recorded")
    quant.add_argument(
        "--scale-mode",
        choices=["floor", "rceil", "compressed-tensors"],
        default="floor",
        help="E8M0 scale rule: OCP floor, NVIDIA rceil, or compressed-tensors' MXFP8 rule",
    )
    quant.add_argument(
        "--skip",
        nargs="*",
        default=argparse.SUPPRESS,
        help="layers to keep, names or globs (each must match one) (default: lm_head)",
    )
    quant.add_argument("--force", action="store_true", help="replace the output folder's contents if it has any")
    quant.add_argument("--device", default="cpu", help="where weights are quantized (cpu, cuda); same bytes either way")
    quant.add_argument("--max-shard-size", default="5GB", help="largest output shard, with a unit (5GB, 500MB, 2GiB)")
    tune = command("tune", "tune the resolved backend's tactics for a shape set and cache them")
    tune.add_argument("--model", nargs="+", choices=sorted(MODELS), default=["llama3-8b"], help="shape sets")
    tune.add_argument("--m", type=int, nargs="+", help="token counts (default: every tuning bucket)")
    tune.add_argument("--shapes", help="explicit shapes MxNxK,MxNxK (overrides --model/--m)")
    tune.add_argument("--model-dir", help="a Hugging Face model folder: tune its linear layers (overrides --model)")
    tune.add_argument("--skip", nargs="*", default=["lm_head"], help="with --model-dir: linear layers to leave out")
    tune.add_argument("--force", action="store_true", help="re-tune problems the cache already has")
    tune.add_argument(
        "--moe",
        nargs="*",
        choices=sorted(MOE_MODELS),
        help="the experts' grouped weights of these mixtures of experts instead (none named: all), at --m tokens "
        "(default: mxgemm bench --moe's)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    args = parser.parse_args(argv)
    args.argv = argv
    if args.command is None:  # bare `mxgemm`: what it can do
        parser.print_help()
        return 0
    console = Console(width=None if sys.stdout.isatty() else 220)
    try:
        if args.command == "info":
            return _info(console)
        if args.command == "quantize":
            return _quantize(args, console)
        if args.command == "tune":
            return _tune(args, console)
        return _bench(args, console)
    except (MXGemmError, ValueError, OSError) as exc:  # user mistakes and the file system's answers: one line
        if args.debug:
            raise
        console.print(f"[red]error:[/red] {escape(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)}")
        return 2
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM during quantize: what was being written is already cleaned up
        if args.debug:
            raise
        console.print("[yellow]interrupted[/yellow]")
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
