"""`atomctl generate`: one-shot generation from the terminal, streamed as it comes."""
import json
import sys
import time
from pathlib import Path
from typing import List, Optional

import typer

from atomctl.engine_options import engine_kwargs, with_engine_options
from atomctl.errors import friendly_errors


def read_prompts(prompts: List[str], file: Optional[Path]) -> List[str]:
    """Prompts from arguments, a file (one per line), or stdin ('-' or nothing on a pipe)."""
    out = [p for p in prompts if p != "-"]
    if file is not None:
        if not file.exists():
            raise ValueError(f"prompt file not found: {file}")
        out += [line for line in file.read_text().splitlines() if line.strip()]
    if "-" in prompts or (not out and not sys.stdin.isatty()):
        text = sys.stdin.read()
        out += [line for line in text.splitlines() if line.strip()]
    if not out:
        raise ValueError("no prompt given; pass it as an argument, with --file, or on stdin")
    return out


def read_images(paths: List[Path]) -> List[bytes]:
    out = []
    for path in paths:
        if not path.is_file():
            raise ValueError(f"image file not found: {path}")
        out.append(path.read_bytes())
    return out


def apply_chat(engine, prompt: str, chat: Optional[bool]) -> str:
    tok = engine.tokenizer
    has_template = tok is not None and getattr(tok, "chat_template", None)
    if chat is None:
        chat = bool(has_template)
    if not chat:
        return prompt
    if not has_template:
        raise ValueError("--chat needs a tokenizer with a chat template")
    return tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)


@friendly_errors
@with_engine_options
def generate_cmd(
    prompts: List[str] = typer.Argument(None, help="Prompt(s); '-' reads stdin."),
    file: Optional[Path] = typer.Option(None, "--file", "-f", help="Read prompts from a file, one per line."),
    chat: Optional[bool] = typer.Option(None, "--chat/--no-chat", help="Apply the chat template (default: when the tokenizer has one)."),
    max_tokens: int = typer.Option(64, help="Max new tokens per prompt."),
    temperature: float = typer.Option(0.0, help="0 = greedy (the default here)."),
    top_p: float = typer.Option(1.0),
    top_k: int = typer.Option(-1),
    min_p: float = typer.Option(0.0),
    sampling_seed: Optional[int] = typer.Option(None, "--sampling-seed", help="Per-request sampling seed."),
    stop: List[str] = typer.Option(None, "--stop", help="Stop string (repeatable)."),
    ignore_eos: bool = typer.Option(False, "--ignore-eos"),
    repetition_penalty: float = typer.Option(1.0),
    presence_penalty: float = typer.Option(0.0),
    frequency_penalty: float = typer.Option(0.0),
    as_json: bool = typer.Option(False, "--json", help="Print the output dicts as JSON."),
    lora: Optional[str] = typer.Option(None, "--lora", help="Run the prompts with this LoRA adapter (a --lora-modules name; needs --enable-lora)."),
    image: List[Path] = typer.Option(None, "--image", help="An image file each prompt asks about (repeatable; a vision-language model, through its chat template)."),
    engine_args: dict = None,
):
    """Generate text for one or more prompts.

    The built-in demo model (--model demo) was trained on small arithmetic: sums and differences
    of 0-99, a three-digit number plus a two-digit one, products up to 12 x 12 and two-digit x
    one-digit. Outside that (e.g. 123 + 456) its answers are wrong.
    """
    from atom_core import LLMEngine, SamplingParams

    user_prompts = read_prompts(prompts or [], file)
    params = SamplingParams(
        temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p, seed=sampling_seed,
        max_tokens=max_tokens, stop=stop or [], ignore_eos=ignore_eos, repetition_penalty=repetition_penalty,
        presence_penalty=presence_penalty, frequency_penalty=frequency_penalty,
    )
    images = read_images(image or [])
    if images and chat is False:
        raise ValueError("--image needs the chat template (it places the image); drop --no-chat")
    engine = LLMEngine(**engine_kwargs(engine_args))
    if images:
        texts = [engine.image_chat_prompt(t, len(images)) for t in user_prompts]
    else:
        texts = [apply_chat(engine, t, chat) for t in user_prompts]
    per_prompt = [images] * len(texts) if images else None
    start = time.perf_counter()
    if as_json or len(texts) > 1:
        outputs = engine.generate(texts, params, lora=lora, images=per_prompt)
        if as_json:
            print(json.dumps(outputs, indent=2))
        else:
            for prompt, out in zip(user_prompts, outputs):  # what the user typed, not the chat template
                print(f"--- {prompt}\n{out['text']}")
    else:
        def on_token(_state, _ids, text):
            sys.stdout.write(text)
            sys.stdout.flush()

        engine.add_request(texts[0], params, stream_callback=on_token, lora=lora, images=per_prompt)
        outputs = []
        while not engine.is_finished():
            outputs += [s.as_dict() for s in engine.step() if s.finished]
        sys.stdout.write("\n")
    _print_stats(outputs, time.perf_counter() - start, engine)


def _print_stats(outputs: list, elapsed: float, engine) -> None:
    n_out = sum(o["num_tokens_output"] for o in outputs)
    ttft = sum(o["ttft"] for o in outputs) / max(len(outputs), 1)
    tpot = sum(o["tpot"] for o in outputs) / max(len(outputs), 1)
    print(f"[{len(outputs)} request(s), {n_out} tokens, TTFT {ttft * 1000:.1f} ms, TPOT {tpot * 1000:.1f} ms, "
          f"{n_out / max(elapsed, 1e-9):.1f} tok/s]", file=sys.stderr)
    if engine.config.speculative.method is not None:
        from atom_core.spec_decode.stats import spec_decode_summary

        print(f"[speculative: {spec_decode_summary(engine.spec_decode_stats())}]", file=sys.stderr)


def register(app: typer.Typer) -> None:
    app.command("generate")(generate_cmd)
