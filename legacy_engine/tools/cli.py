"""The `legacy-engine` command line.

  legacy-engine run MODEL -p TEXT       generate text (streams, then a timing line)
  legacy-engine chat MODEL              interactive chat: a line per turn from stdin, /reset, /exit
  legacy-engine info [MODEL] [--json]   what the machine has and chose; a model's architecture and tensors
  legacy-engine demo                    generate with the built-in tiny MoE model (made on first use, cached)
  legacy-engine make-model …            random-weight GGUFs in llama.cpp's layout (see make-model -h)
  legacy-engine convert HF_DIR OUT.gguf Hugging Face Qwen3.5/3.6 checkpoint to GGUF (see convert -h)
  legacy-engine tokenize MODEL TEXT     token ids as the model's own tokenizer gives them
  legacy-engine serve MODEL             OpenAI-compatible HTTP server (see serve -h)
  legacy-engine bench decode|cache MODEL  benchmarks: tok/s per CPU tier vs llama.cpp; prefix cache (bench -h)
  legacy-engine build-kernels …         compile cuda8/ to PTX for every GPU tier (see build-kernels -h)

Errors the user can fix (a bad file, a missing feature) print one line and exit 1; bad flags exit 2, and are
checked before a model loads. LE_DEBUG=1 adds the C core's file:line and the traceback.
"""
from __future__ import annotations

import argparse
import atexit
import dataclasses
import json
import os
import re
import sys
import time

from .. import __version__
from ..core.errors import ContextLengthError, EngineError, NativeError
from ..core.paths import cache_dir
from ..cpu.threads import format_report, report
from ..format.chat import TemplateRenderer, render_chat, render_prompt
from ..format.gguf_file import GGUFFile
from ..format.gguf_model import ModelFile, check_tensor_values
from ..format.mmproj import MmprojFile, encode_flops, is_mmproj
from ..format.tokenizer import Tokenizer
from ..gpu.commands import cli_build
from ..gpu.vision import tower_footprint
from ..plan import probe
from ..plan.caps import format_machine_report, machine_report
from ..plan.vision import VISION_REF_SIDE, predict_encode_s, ref_patches
from ..serve import generate
from ..serve.sampling import SamplingParams
from .bench_cmd import main as bench_main
from .convert import main as convert_main
from .flags import CHECK_TENSORS_HELP, check_gpu, engine_kwargs, gpu_flags, load_flags
from .make_model import main as make_main
from .make_model import make_model
from .plan_cmd import main as plan_main
from .serve_cmd import add_serve_parser

DEMO_PRESET = "tiny-moe"
DEMO_SEED = 1234
CHAT_HELP = ("a line per turn; /image PATH adds an image to the next turn (with --mmproj), /reset forgets the "
             "conversation, /exit (or Ctrl-D) ends it, Ctrl-C stops an answer")


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def model_report(path: str, check_tensors: bool = False) -> tuple[dict, list[str]]:
    """`info MODEL`'s (JSON data, text lines); check_tensors: scan every tensor's values too (FormatError on the
    first non-finite one)."""
    t0 = time.perf_counter()
    m = ModelFile.open(path)
    load_s = time.perf_counter() - t0
    checked = check_tensor_values(m.gguf) if check_tensors else None
    hp = m.hparams
    total = sum(t.n_bytes for t in m.tensors.values())
    by_type = m.bytes_by_type()
    data = {"path": m.path, "file_bytes": m.gguf.file_size, "gguf_version": m.gguf.version,
            "open_seconds": round(load_s, 3), "hparams": hp.summary(),
            "tensors": len(m.tensors), "tensor_bytes": total,
            "types": {k: {"tensors": c, "bytes": b} for k, (c, b) in by_type.items()},
            "layout": {k: v for k, v in m.layout.items() if v}}
    lines = [f"model    {m.path}",
             f"  GGUF v{m.gguf.version}, {_fmt_bytes(m.gguf.file_size)}, {len(m.tensors)} tensors, "
             f"opened and validated in {load_s:.2f} s",
             f"  name: {m.metadata.get('general.name', '?')}   architecture: {hp.arch}"
             + ("  (MoE)" if hp.is_moe else "  (dense)")]
    nl = hp.n_layer
    n_gdn = sum(hp.recurrent)
    lines.append(f"  layers to run: {nl} ({n_gdn} Gated DeltaNet, {nl - n_gdn} full attention)"
                 + (f"; {hp.n_nextn} MTP layer(s) in the file are skipped" if hp.n_nextn else ""))
    lines.append(f"  pattern: {hp.summary()['recurrent']}")
    lines.append(f"  n_embd {hp.n_embd}, vocab {hp.n_vocab}, context {hp.n_ctx_train}, "
                 f"embeddings {'tied' if hp.tied_embeddings else 'untied'}")
    lines.append(f"  attention: {hp.n_head} heads, {hp.n_head_kv} KV heads, head_dim {hp.head_dim}, "
                 f"RoPE {hp.n_rot} dims theta {hp.rope_theta:g} sections {list(hp.rope_sections)}")
    lines.append(f"  deltanet: H_k {hp.ssm_n_group}, H_v {hp.ssm_dt_rank}, d_k {hp.ssm_d_state}, "
                 f"d_v {hp.d_v}, conv kernel {hp.ssm_conv_kernel}")
    if hp.is_moe:
        lines.append(f"  MoE: {hp.n_expert} experts, top-{hp.n_expert_used}, expert FFN {hp.n_ff_exp}, "
                     f"shared expert FFN {hp.n_ff_shexp or 'none'}")
    else:
        lines.append(f"  FFN: {hp.n_ff}")
    lines.append(f"  rms eps {hp.rms_eps:g}")
    if data["layout"]:
        lines.append("  alternative tensor layouts: " + ", ".join(data["layout"]))
    lines.append(f"  tensor bytes: {_fmt_bytes(total)}")
    for name, (count, nbytes) in by_type.items():
        lines.append(f"    {name:<8} {count:>5} tensors  {_fmt_bytes(nbytes):>12}  {100 * nbytes / max(total, 1):5.1f} %")
    tok = m.metadata.get("tokenizer.ggml.model")
    if tok:
        lines.append(f"  tokenizer: {tok} / {m.metadata.get('tokenizer.ggml.pre', '?')}, "
                     f"{len(m.metadata.get('tokenizer.ggml.tokens', []))} tokens, "
                     f"chat template {'present' if 'tokenizer.chat_template' in m.metadata else 'absent (ChatML)'}")
    if checked is not None:
        data["tensor_check"] = checked
        lines.append(f"  tensor values: finite ({checked['tensors'] - len(checked['unchecked'])} tensors, "
                     f"{_fmt_bytes(checked['bytes'])} scanned in {checked['seconds']:.2f} s"
                     + (f"; {len(checked['unchecked'])} of a type without float fields not checked"
                        if checked["unchecked"] else "") + ")")
    return data, lines


def mmproj_report(path: str) -> tuple[dict, list[str]]:
    """`info FILE`'s (JSON data, text lines) for a vision projector (mmproj) GGUF."""
    m = MmprojFile.open(path)
    v = m.hparams
    total = sum(t.n_bytes for t in m.tensors.values())
    types = sorted({t.type_name for t in m.tensors.values()})
    data = {"path": m.path, "file_bytes": m.gguf.file_size, "vision": dataclasses.asdict(v), "tensors": len(m.tensors),
            "tensor_bytes": total, "types": types}
    lines = [f"mmproj   {m.path}",
             f"  GGUF v{m.gguf.version}, {_fmt_bytes(m.gguf.file_size)}, {len(m.tensors)} tensors ({', '.join(types)}): "
             f"a Qwen3.5/3.6 vision tower (qwen3vl_merger)",
             f"  ViT: {v.depth} blocks, hidden {v.hidden}, {v.n_head} heads (head_dim {v.head_dim}), FFN {v.ffn}, "
             f"patch {v.patch_size} x temporal {v.temporal_patch}, {v.pos_side}x{v.pos_side} learned positions",
             f"  merger: {v.merge}x{v.merge} patches -> one LM token of {v.out_hidden} (the LM's n_embd must match)",
             f"  images resized to {v.min_pixels:,}…{v.max_pixels:,} pixels, sides multiples of {v.patch_size * v.merge}"
             f"; mean {list(v.image_mean)}, std {list(v.image_std)}",
             "  use: run MODEL --mmproj FILE --image PATH"]
    fp, n_ref = tower_footprint(v), ref_patches(v)
    data["gpu_vram"] = fp.parts
    lines.append(f"  on a GPU: {fp.describe()} for images up to {v.max_patches:,} patches; an encode of a "
                 f"{VISION_REF_SIDE}x{VISION_REF_SIDE} image ({n_ref:,} patches) is "
                 f"{encode_flops(v, n_ref) / 1e12:.2f} TFLOP")
    ms = [m for m in (probe.machine_from_json(d) for d in probe.cached_machines().values()) if m and m.has_gpu]
    if ms:   # the latest cached probe's rates (plan/vision.py); where it runs depends on the model beside it
        mach = max(ms, key=lambda x: x.measured_at)
        pred = data["predicted_encode_s"] = predict_encode_s(v, mach, n_ref)
        lines.append(f"  predicted on this machine (cached probe): {pred['gpu']:.2f} s on the {mach.gpu_name}, "
                     f"{pred['cpu']:.2f} s on {mach.cpu_threads} CPU threads")
    lines.append("  the tower runs on the CPU, or with --gpu where the planner puts it: "
                 "`legacy-engine plan MODEL --mmproj FILE [--vram SIZE]` shows the decision")
    return data, lines


def cmd_info(args) -> int:
    rep = machine_report()
    try:
        saved = probe.cached_machines()
        planner = probe.format_machines(saved)
    except Exception as e:  # why: a damaged probe cache must not hide the rest of the report
        saved = {"error": f"{type(e).__name__}: {e}"}
        planner = [f"Planner  the cached machine probes are unreadable ({type(e).__name__}: {e}); "
                   "`legacy-engine plan --remeasure` measures them again"]
    load = report()  # other work on the CPUs now: the default threads and pinning (issue 21)
    data = {"machine": rep, "planner_probes": saved, "cpu_load": load}
    lines = [f"legacy_engine {__import__('legacy_engine').__version__}"] + format_machine_report(rep)
    lines += format_report(load) + planner
    if args.model and is_mmproj(GGUFFile(args.model).metadata):
        data["mmproj"], mlines = mmproj_report(args.model)
        lines += mlines
    elif args.model:
        mdata, mlines = model_report(args.model, check_tensors=getattr(args, "check_tensors", False))
        data["model"] = mdata
        lines += mlines
    if args.json:
        print(json.dumps(data, indent=2, default=str))
    else:
        print("\n".join(lines))
    return 0


def demo_model_path() -> str:
    """The built-in default model: a deterministic tiny MoE, made on first use and cached."""
    path = os.path.join(cache_dir(), f"demo-{DEMO_PRESET}-seed{DEMO_SEED}.gguf")
    if not os.path.exists(path):
        print(f"making the built-in demo model ({DEMO_PRESET}, seed {DEMO_SEED}) at {path} …", file=sys.stderr)
        make_model(DEMO_PRESET, path, seed=DEMO_SEED)
    return path


def _sampling(args):
    return SamplingParams(temperature=args.temp, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                          repetition_penalty=args.repeat_penalty, presence_penalty=args.presence_penalty,
                          frequency_penalty=args.frequency_penalty, seed=args.seed)


def _preflight(args):
    """What the flags of run/chat/demo can get wrong, checked before a model loads -> (SamplingParams, Engine
    kwargs): the sampling ranges, the --gpu flags, and a GPU to run them on."""
    params = _sampling(args)
    params.validate()
    kw = engine_kwargs(args)
    if kw["gpu"]:
        check_gpu()
    return params, kw


def _upload_bar(names):
    from tqdm import tqdm

    return tqdm(names, desc="upload to the GPU", unit="tensor", leave=False, disable=None)  # None: terminals only


def load_engine(path: str, kw: dict):
    """Engine(path, **kw). On a terminal, stderr shows `loading NAME (SIZE) …` while it loads (a GPU upload: a tqdm
    bar), cleared when done: the timing line after the answer reports the load time, and a pipe or a log gets no
    carriage returns."""
    status = sys.stderr.isatty()
    if status:
        size = f" ({_fmt_bytes(os.path.getsize(path))})" if os.path.isfile(path) else ""
        print(f"loading {os.path.basename(path)}{size} …", end="", file=sys.stderr, flush=True)
    try:
        return generate.Engine(path, progress=_upload_bar if kw.get("gpu") else None, **kw)
    finally:
        if status:
            print("\r\033[K", end="", file=sys.stderr, flush=True)


def _describe_gpu(eng) -> None:
    if eng.gpu is not None:
        print(eng.model.describe(), file=sys.stderr)
        print(f"placement: {eng.placement.why}", file=sys.stderr)
    if eng.vision is not None and eng.gpu is not None:
        print(f"vision tower: on {eng.vision_where}", file=sys.stderr)


def _max_tokens(args, eng) -> int:
    """-n N, or -n -1: until the model stops or the context is full."""
    return eng.n_ctx if args.n_predict < 0 else args.n_predict


def _print_text(t: str) -> None:
    print(t, end="", flush=True)


def _generate(path: str, args, messages_or_text, chat: bool, checked=None, image_paths=()) -> int:
    params, kw = checked or _preflight(args)
    eng = load_engine(path, kw)
    _describe_gpu(eng)
    images = eng.load_images(image_paths) if image_paths else None
    sess = eng.session()
    prompt = messages_or_text
    if chat:  # user text that spells a control token stays text (chat.render_prompt)
        renderer = TemplateRenderer()   # the model file's template may not end: a process stopped after its limit
        try:
            prompt = eng.tokenizer.encode_prompt(*eng.chat_text(
                messages_or_text, enable_thinking=not args.no_think, special_in_user_text=args.special_in_user_text,
                render=renderer.render))
        finally:
            renderer.close()
    res = sess.generate(prompt, max_tokens=_max_tokens(args, eng), params=params, stop=args.stop,
                        on_text=_print_text, images=images)
    print()
    print(f"[{res.finish_reason}] {res.timings.summary()}", file=sys.stderr)
    return 0


def cmd_run(args) -> int:
    if args.chat:
        return cmd_chat(args)
    if args.prompt is None:
        args.parser.error("give a prompt with -p TEXT, or use `legacy-engine chat`")  # exits 2, like any bad flag
    if not args.prompt:
        args.parser.error("empty prompt: nothing to run (give some text with -p)")
    if args.image:     # as llama.cpp's mtmd-cli: the images and the text as one user turn of the chat template
        if not args.mmproj:
            args.parser.error("--image needs the model's vision projector: --mmproj FILE")
        parts = [{"type": "image"} for _ in args.image] + [{"type": "text", "text": args.prompt}]
        return _generate(args.model, args, [{"role": "user", "content": parts}], chat=True, image_paths=args.image)
    return _generate(args.model, args, args.prompt, chat=False)


_PROBE = [{"role": "user", "content": "probe-u1"}, {"role": "assistant", "content": "probe-a1"},
          {"role": "user", "content": "probe-u2"}]


def _turn_renderer(eng, enable_thinking: bool, specials=(), render_fn=None):
    """(closing, turn) when the chat template renders a user turn the same alone as after earlier turns (checked
    on a probe conversation): closing = the text after an answer that ends its turn, turn(m) = user message m and
    the generation prompt. Then a chat feeds only those, as llama.cpp's does, and the state keeps what the model
    really said (its <think> block too, which the template drops from earlier turns). None otherwise: the whole
    conversation runs again every turn."""
    render_fn = render_fn or render_chat

    def render(msgs, gen):
        return render_fn(msgs, eng.chat_template, add_generation_prompt=gen, enable_thinking=enable_thinking)
    try:
        new, whole = render(_PROBE[2:], True), render(_PROBE, True)
    except Exception:   # a template that refuses the probe (jinja raises many types): no shortcut
        return None
    answer = _PROBE[1]["content"]
    if not whole.endswith(new) or whole.count(answer) != 1:
        return None
    head = whole[:len(whole) - len(new)]      # ... user u1, assistant a1 and the end of its turn
    return head[head.index(answer) + len(answer):], lambda m: render_prompt(    # (text, literal spans)
        [m], eng.chat_template, specials, render=render_fn, add_generation_prompt=True,
        enable_thinking=enable_thinking)


def _image_command(eng, command: str, pending: list) -> None:
    """/image PATH: the image joins the next user turn (pending); a bad path or image is said and forgotten."""
    path = command[len("/image"):].strip()
    try:
        pending += eng.load_images([path])
        print(f"(image {os.path.basename(path)}: {pending[-1].n_tokens} tokens, with the next message)",
              file=sys.stderr)
    except (OSError, EngineError, ValueError) as e:
        print(f"legacy-engine: {e}", file=sys.stderr)


def cmd_chat(args) -> int:
    """Interactive chat through the model's chat template, one user turn per line of stdin (CHAT_HELP). The session
    keeps its state between turns, so a turn runs only the tokens it adds (_turn_renderer)."""
    params, kw = _preflight(args)
    eng = load_engine(args.model, kw)
    _describe_gpu(eng)
    think = not args.no_think
    renderer = TemplateRenderer()   # the model file's template may not end: a process stopped after its limit
    atexit.register(renderer.close)
    incremental = _turn_renderer(eng, think, () if args.special_in_user_text else eng.tokenizer.control_tokens,
                                 renderer.render)
    system = [{"role": "system", "content": args.prompt}] if args.prompt else []
    messages, sess = list(system), eng.session()
    pending, seen = [], []      # images for the next turn; every image of the conversation (a re-run needs them)
    tty = sys.stdin.isatty()
    if tty:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
        print(f"chat with {os.path.basename(args.model)}: {CHAT_HELP}", file=sys.stderr)
    while True:
        try:
            line = input("> " if tty else "")
        except EOFError:
            break
        command = line.strip()
        if command in ("/exit", "/quit", "/bye"):
            break
        if command.startswith("/image"):
            _image_command(eng, command, pending)
            continue
        if command == "/reset":
            messages, pending, seen = list(system), [], []
            sess.reset()
            print("(conversation reset)", file=sys.stderr)
            continue
        if not command:
            continue
        user = {"role": "user", "content": [{"type": "image"} for _ in pending] + [{"type": "text", "text": line}]
                if pending else line}
        turn_images, seen, pending = pending, seen + pending, []
        if incremental and sess.tokens:   # the session holds the conversation up to the last answer
            closing, turn = incremental
            text, literal = turn(user)    # user text that spells a control token stays text (chat.render_prompt)
            ids = eng.tokenizer.encode_prompt(closing + text, [(a + len(closing), b + len(closing))
                                                               for a, b in literal], add_bos=False)
        else:
            sess.reset()
            turn_images = seen
            ids = eng.tokenizer.encode_prompt(*eng.chat_text(messages + [user], enable_thinking=think,
                                                             special_in_user_text=args.special_in_user_text,
                                                             render=renderer.render))
        sess.timings = generate.Timings(load_s=eng.load_s)     # this turn's numbers
        try:
            res = sess.generate(ids, max_tokens=_max_tokens(args, eng), params=params, stop=args.stop,
                                on_text=_print_text, images=turn_images)
        except ContextLengthError as e:   # refused before it ran: the state is as it was
            print(f"legacy-engine: {e}; /reset starts a new conversation", file=sys.stderr)
            continue
        except KeyboardInterrupt:   # stops this answer, not the chat; the state may be mid-token: the next turn
            sess.reset()            # runs the whole conversation again
            print("\n[interrupted]", file=sys.stderr)
            continue
        print()
        print(f"[{res.finish_reason}] {res.timings.summary()}", file=sys.stderr)
        messages += [user, {"role": "assistant", "content": res.text}]
    return 0


def cmd_demo(args) -> int:
    checked = _preflight(args)   # bad flags, or --gpu without a GPU, fail before the demo model is made
    path = demo_model_path()
    _, lines = model_report(path)
    print("\n".join(lines), file=sys.stderr)
    print(f"\nuser: {args.prompt}\nassistant (random weights, so the words are noise):", file=sys.stderr)
    return _generate(path, args, [{"role": "user", "content": args.prompt}], chat=True, checked=checked)


def token_text(b: bytes) -> str:
    """A token's bytes as a quoted piece of text: UTF-8 as text (quotes, backslashes and control characters escaped
    as in a Python string), each byte that is not part of a whole UTF-8 character as \\xNN."""
    out, i = [], 0
    while i < len(b):
        for n in range(1, min(4, len(b) - i) + 1):
            try:
                ch = b[i:i + n].decode("utf-8")
            except UnicodeDecodeError:
                continue
            out.append("\\'" if ch == "'" else repr(ch)[1:-1])
            i += n
            break
        else:
            out.append(f"\\x{b[i]:02x}")
            i += 1
    return "'" + "".join(out) + "'"


def cmd_tokenize(args) -> int:
    f = GGUFFile(args.model)
    tok = Tokenizer.from_metadata(f.metadata)
    ids = tok.encode(args.text, special=not args.no_special)
    if args.json:
        print(json.dumps(ids))
    else:
        for i in ids:
            print(f"{i:>8}  {token_text(tok.token_bytes(i))}")
    return 0


def _positive_int(v: str) -> int:
    n = int(v)
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {v}")
    return n


def _n_predict(v: str) -> int:
    n = int(v)
    if n < -1:
        raise argparse.ArgumentTypeError(f"expected a token count >= 0, or -1 (until the model stops), got {v}")
    return n


def _seed(v: str) -> int | None:
    n = int(v)
    if n < -1:
        raise argparse.ArgumentTypeError(f"expected a seed >= 0, or -1 for a random one, got {v}")
    return None if n == -1 else n


def _gen_flags(s, n_predict: int = 128) -> None:
    """The generation flags of run, chat and demo (checked before the model loads: _preflight)."""
    until = "-1: until the model stops or the context is full"
    s.add_argument("-n", "--n-predict", type=_n_predict, default=n_predict, metavar="N",
                   help=f"tokens to generate per answer ({until}; default {n_predict})")
    s.add_argument("-t", "--threads", type=_positive_int, default=None, help="CPU threads (default: all cores)")
    load_flags(s)
    gpu_flags(s)
    s.add_argument("-c", "--ctx", type=_positive_int, default=4096, help="context length in tokens (default 4096)")
    s.add_argument("--temp", type=float, default=0.0, help="temperature; 0 = greedy (default)")
    s.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    s.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    s.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability")
    s.add_argument("--repeat-penalty", type=float, default=1.0, help="repetition penalty (1 = off)")
    s.add_argument("--presence-penalty", type=float, default=0.0, help="presence penalty")
    s.add_argument("--frequency-penalty", type=float, default=0.0, help="frequency penalty")
    s.add_argument("--seed", type=_seed, default=None, metavar="S",
                   help="random seed: same seed, same text (default -1: a random one)")
    s.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    s.add_argument("--no-think", action="store_true", help="chat: disable the <think> block")
    s.add_argument("--special-in-user-text", action="store_true",
                   help="chat: parse control tokens (<|im_start|> ...) typed in messages; default: they are text")
    s.add_argument("--mmproj", default=None, metavar="FILE",
                   help="the model's vision projector (llama.cpp's mmproj GGUF): images in prompts (--image, chat's "
                        "/image)")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="legacy-engine", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"legacy_engine {__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    s = sub.add_parser("info", help="machine capabilities, chosen paths, and a model's structure")
    s.add_argument("model", nargs="?", help="a GGUF file to describe")
    s.add_argument("--json", action="store_true", help="print JSON instead of text")
    s.add_argument("--check-tensors", action="store_true", help="with MODEL: " + CHECK_TENSORS_HELP)
    s.set_defaults(func=cmd_info)

    s = sub.add_parser("run", help="generate text from MODEL")
    s.add_argument("model", help="a Qwen3.5/3.6 GGUF file")
    s.add_argument("-p", "--prompt", help="the prompt (raw text; with --chat: a system message)")
    s.add_argument("--chat", action="store_true", help="the same as `legacy-engine chat MODEL`")
    s.add_argument("--image", action="append", default=None, metavar="PATH",
                   help="an image (PNG, JPEG, WebP, GIF) the prompt asks about, before its text, through the chat "
                        "template (repeatable; needs --mmproj)")
    _gen_flags(s)
    s.set_defaults(func=cmd_run, parser=s)

    s = sub.add_parser("chat", help="interactive chat with MODEL through its chat template",
                       description=f"Interactive chat with MODEL through its chat template: {CHAT_HELP}.")
    s.add_argument("model", help="a Qwen3.5/3.6 GGUF file")
    s.add_argument("-p", "--prompt", "--system", dest="prompt", metavar="TEXT", help="a system message")
    _gen_flags(s, n_predict=-1)
    s.set_defaults(func=cmd_chat)

    s = sub.add_parser("demo", help="generate with the built-in tiny MoE model")
    s.add_argument("-p", "--prompt", default="Hello! What can a 2012 GPU still do?", help="the user message")
    _gen_flags(s, n_predict=32)
    s.set_defaults(func=cmd_demo)

    s = sub.add_parser("tokenize", help="token ids of TEXT with MODEL's tokenizer")
    s.add_argument("model", help="a GGUF file")
    s.add_argument("text", help="the text to tokenize")
    s.add_argument("--no-special", action="store_true", help="treat special-token text as plain text")
    s.add_argument("--json", action="store_true", help="print the ids as a JSON list")
    s.set_defaults(func=cmd_tokenize)

    add_serve_parser(sub)

    # make-model and convert own their flags; they are parsed by their modules
    sub.add_parser("make-model", help="write a random-weight GGUF (make-model -h for flags)", add_help=False)
    sub.add_parser("convert", help="convert a Hugging Face checkpoint to GGUF (convert -h for flags)",
                   add_help=False)
    sub.add_parser("bench", help="benchmarks: bench decode MODEL, bench cache MODEL (bench -h for the list)",
                   add_help=False)
    sub.add_parser("build-kernels", help="build cuda8/ PTX for every GPU tier (build-kernels -h for flags)",
                   add_help=False)
    sub.add_parser("plan", help="predicted speed of every CPU/GPU split for MODEL and the one chosen (plan -h)",
                   add_help=False)
    return p


_C_LOCATION = re.compile(r"\b[\w./-]+\.(?:c|h|cu|cuh):\d+: ")   # le_fail's "threads.c:125: " in a NativeError


def error_text(e: EngineError) -> str:
    """The message a user sees: a NativeError without the C function and file:line it carries (LE_DEBUG=1 keeps
    them); e.code still says which status the C core returned."""
    text = str(e)
    if isinstance(e, NativeError) and not os.environ.get("LE_DEBUG"):
        text = _C_LOCATION.sub("", re.sub(r"^le_\w+: ", "", text))
    return text


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    for stream in (sys.stdout, sys.stderr):  # generated text is any Unicode: never die on an ASCII terminal
        if hasattr(stream, "reconfigure") and (stream.encoding or "").lower().replace("-", "") != "utf8":
            stream.reconfigure(errors="backslashreplace")
    try:
        if argv and argv[0] == "make-model":
            return make_main(argv[1:])
        if argv and argv[0] == "convert":
            return convert_main(argv[1:])
        if argv and argv[0] == "bench":
            return bench_main(argv[1:])
        if argv and argv[0] == "plan":
            return plan_main(argv[1:])
        if argv and argv[0] == "build-kernels":
            return cli_build(argv[1:])
        args = build_parser().parse_args(argv)
        return args.func(args)
    except EngineError as e:
        print(f"legacy-engine: error: {error_text(e)}", file=sys.stderr)
        if os.environ.get("LE_DEBUG"):
            raise
        return 1
    except ValueError as e:  # bad values that argparse cannot see (a sampling range, an empty prompt)
        print(f"legacy-engine: error: {e}", file=sys.stderr)
        return 2
    except FileNotFoundError as e:
        print(f"legacy-engine: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("legacy-engine: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
