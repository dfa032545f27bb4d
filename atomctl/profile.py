"""`atomctl profile` (an offline profiled run) and `atomctl parse-trace` (kernel breakdowns)."""
from __future__ import annotations

import random
from pathlib import Path
from typing import List, Optional

import typer

from atomctl.engine_options import engine_kwargs, with_engine_options
from atomctl.errors import friendly_errors

DEFAULT_PROFILER_DIR = "./profiler_traces"


@friendly_errors
def parse_trace_cmd(
    trace: Path = typer.Argument(..., help="A Chrome trace (.json or .json.gz) written by atom_core."),
    layer: int = typer.Option(3, "--layer", help="The layer shown in the layer_N sheet."),
    out_dir: Path = typer.Option(Path("."), "--out-dir", help="Where the xlsx (and png) files go."),
    plot: bool = typer.Option(False, "--plot", help="Also write a PNG bar chart per phase."),
    capture_trace: Optional[List[Path]] = typer.Option(
        None, "--capture-trace", help="CUDA-graph capture trace(s) (default: capture_bs* files beside TRACE)."
    ),
    top: int = typer.Option(20, "--top", help="Rows of each breakdown printed."),
):
    """Per-kernel breakdown of the prefill and decode steps of a trace, by module and layer."""
    from atom_core.profiling.breakdown import parse_trace
    from atom_core.profiling.report import print_breakdown, write_plots, write_workbooks

    breakdown = parse_trace(trace, layer=layer, capture_paths=capture_trace or None)
    print_breakdown(breakdown, top=top)
    if breakdown.capture_sources:
        print(f"CUDA-graph capture traces read: {', '.join(breakdown.capture_sources)}")
    if breakdown.uses_cpu_rule:
        print("CPU trace: CPU ops (self time) stand in for kernels")
    written = write_workbooks(breakdown, out_dir)
    if plot:
        written += write_plots(breakdown, out_dir)
    for path in written:
        print(f"wrote {path}")


@friendly_errors
@with_engine_options
def profile_cmd(
    input_length: Optional[int] = typer.Option(None, "--input-length", help="Prompt tokens per sequence (default "
                                               "128; with --image the chat template and the images set the prompt)."),
    output_length: int = typer.Option(32, "--output-length", help="Generated tokens per sequence."),
    bs: int = typer.Option(4, "--bs", help="Sequences in the profiled batch."),
    random_input: bool = typer.Option(False, "--random-input", help="Random prompt token ids (default: a fixed pattern)."),
    mark_trace: Optional[bool] = typer.Option(
        None, "--mark-trace/--no-mark-trace", help="Name every module in the trace (eager; default: ATOM_MARK_TRACE)."
    ),
    detailed: Optional[bool] = typer.Option(
        None, "--detailed/--no-detailed", help="Record shapes, stacks, memory (default: ATOM_PROFILER_DETAILED)."
    ),
    image: List[Path] = typer.Option(None, "--image", help="An image file each profiled prompt asks about "
                                     "(repeatable; a vision-language model): the vision encoder runs in the "
                                     "profiled prefill, once per sequence."),
    engine_args: dict = None,
):
    """Profile one batch offline (after a warm-up batch) and print where the traces went."""
    from atom_core import LLMEngine, SamplingParams
    from atom_core.envs import read_envs
    from atom_core.profiling.trace_parser import find_capture_traces

    from atomctl.generate import read_images

    images = read_images(image or [])
    if images and (input_length is not None or random_input):
        flag = "--input-length" if input_length is not None else "--random-input"
        raise ValueError(f"{flag} does not apply with --image: the chat template and the images set the prompt")
    input_length = 128 if input_length is None else input_length
    for name, value in (("--input-length", input_length), ("--output-length", output_length), ("--bs", bs)):
        if value < 1:
            raise ValueError(f"invalid {name} {value}; must be >= 1")
    envs = read_envs()
    kwargs = engine_kwargs(engine_args)
    kwargs["torch_profiler_dir"] = kwargs.get("torch_profiler_dir") or envs.torch_profiler_dir or DEFAULT_PROFILER_DIR
    kwargs["mark_trace"] = envs.mark_trace if mark_trace is None else mark_trace
    kwargs["profiler_detailed"] = envs.profiler_detailed if detailed is None else detailed
    if not images:  # an image prompt's length is the processor's: the model's limit stays
        kwargs.setdefault("max_model_len", input_length + output_length)
    kwargs.setdefault("num_scheduler_steps", 1)  # one range per decode step, as parse-trace expects

    engine = LLMEngine(**kwargs)
    vocab_size = engine.core.vocab_size
    params = SamplingParams(max_tokens=output_length, ignore_eos=True)
    # The warm-up prompts differ from the profiled ones so that prefix caching cannot skip the
    # profiled prefill.
    if images:
        prompt = engine.image_chat_prompt("Describe the image.", len(images))
        engine.generate([prompt] * bs, params, images=image_copies(images, bs, run=1))
        engine.start_profile()
        engine.generate([prompt] * bs, params, images=image_copies(images, bs, run=0))
        inputs = f"{len(images)} image(s) and {len(engine.tokenizer.encode(prompt))} template and text tokens"
    else:
        engine.generate(prompt_token_ids(bs, input_length, vocab_size, random_input, seed=1), params)
        engine.start_profile()
        engine.generate(prompt_token_ids(bs, input_length, vocab_size, random_input, seed=0), params)
        inputs = f"{input_length} tokens"
    paths = engine.stop_profile()
    print(f"profiled bs={bs}, input {inputs}, output {output_length} tokens")
    for path in paths:
        print(f"trace: {path}")
    for path in find_capture_traces(paths[0]) if paths else []:
        print(f"graph capture trace: {path}")
    if paths:
        print(f"next: atomctl parse-trace {paths[0]}")


def prompt_token_ids(bs: int, length: int, vocab_size: int, random_input: bool, seed: int) -> list[list[int]]:
    """`bs` prompts of `length` token ids, distinct per sequence and per seed. Random ids are
    uniform over the vocabulary; the fixed pattern counts up from an offset, wrapping."""
    rng = random.Random(seed)
    prompts = []
    for i in range(bs):
        if random_input:
            prompts.append([rng.randrange(vocab_size) for _ in range(length)])
        else:
            start = (seed * 7919 + i * 104729) % vocab_size
            prompts.append([(start + j) % vocab_size for j in range(length)])
    return prompts


MARK = 4  # side of the blocks that mark an image copy: large enough to survive the processor's resizing


def image_copies(images: list[bytes], bs: int, run: int) -> list[list[bytes]]:
    """Per sequence, its own copy of every image: copy i of run r carries the number 2 i + r in binary, black
    and white MARK-pixel blocks from its top-left corner (as few as 2 bs numbers need), so each copy is encoded, as different requests'
    images are; the encoder cache and the prefix cache (keyed by the processed pixels) hit none of them.
    The size, which sets the encoder's work, stays."""
    import io

    from PIL import Image

    decoded = []
    for data in images:
        try:
            decoded.append(Image.open(io.BytesIO(data)).convert("RGB"))
        except Exception as e:  # noqa: BLE001 - PIL raises several types for a file it cannot read
            raise ValueError(f"cannot decode the image: {e}") from None
    bits = (2 * bs - 1).bit_length()  # every copy of both runs is marked in the same blocks
    for picture in decoded:
        if bits > (picture.width // MARK) * (picture.height // MARK):
            raise ValueError(f"an image of {picture.width}x{picture.height} is too small to mark {bs} copies; "
                             f"use a larger one or a smaller --bs")
    out = []
    for i in range(bs):
        code, row = 2 * i + run, []
        for picture in decoded:
            columns = picture.width // MARK
            copy = picture.copy()
            for k in range(bits):
                x, y = k % columns * MARK, k // columns * MARK
                copy.paste((255, 255, 255) if code >> k & 1 else (0, 0, 0), (x, y, x + MARK, y + MARK))
            buffer = io.BytesIO()
            copy.save(buffer, format="PNG")
            row.append(buffer.getvalue())
        out.append(row)
    return out


def register(app: typer.Typer) -> None:
    app.command("parse-trace")(parse_trace_cmd)
    app.command("profile")(profile_cmd)
