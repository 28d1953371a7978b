"""The `legacy-engine` command line.

  legacy-engine info [MODEL] [--json]   what the machine has and chose; a model's architecture and tensors
  legacy-engine demo                    the built-in tiny MoE model (made on first use, cached)
  legacy-engine make-model …            random-weight GGUFs in llama.cpp's layout (see make-model -h)
  legacy-engine convert HF_DIR OUT.gguf Hugging Face Qwen3.5/3.6 checkpoint to GGUF (see convert -h)
  legacy-engine tokenize MODEL TEXT     token ids as the model's own tokenizer gives them

Errors the user can fix (a bad file, a missing feature) print one line and exit 1; bad flags exit 2.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from .errors import EngineError

DEMO_PRESET = "tiny-moe"
DEMO_SEED = 1234


def cache_dir() -> str:
    """The user cache dir for legacy_engine ($LE_CACHE_DIR, else $XDG_CACHE_HOME/legacy_engine)."""
    d = os.environ.get("LE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "legacy_engine")
    os.makedirs(d, exist_ok=True)
    return d


def _fmt_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


def model_report(path: str) -> tuple[dict, list[str]]:
    from .gguf_model import ModelFile

    t0 = time.perf_counter()
    m = ModelFile.open(path)
    load_s = time.perf_counter() - t0
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
    return data, lines


def cmd_info(args) -> int:
    from .caps import format_machine_report, machine_report

    rep = machine_report()
    data = {"machine": rep}
    lines = [f"legacy_engine {__import__('legacy_engine').__version__}"] + format_machine_report(rep)
    if args.model:
        mdata, mlines = model_report(args.model)
        data["model"] = mdata
        lines += mlines
    if args.json:
        print(json.dumps(data, indent=2, default=str))
    else:
        print("\n".join(lines))
    return 0


def demo_model_path() -> str:
    """The built-in default model: a deterministic tiny MoE, made on first use and cached."""
    from .make_model import make_model

    path = os.path.join(cache_dir(), f"demo-{DEMO_PRESET}-seed{DEMO_SEED}.gguf")
    if not os.path.exists(path):
        print(f"making the built-in demo model ({DEMO_PRESET}, seed {DEMO_SEED}) at {path} …", file=sys.stderr)
        make_model(DEMO_PRESET, path, seed=DEMO_SEED)
    return path


def cmd_demo(args) -> int:
    from .chat import render_chat
    from .gguf_model import ModelFile
    from .tokenizer import Tokenizer

    path = demo_model_path()
    _, lines = model_report(path)
    print("\n".join(lines))
    m = ModelFile.open(path)
    tok = Tokenizer.from_metadata(m.metadata)
    prompt = render_chat([{"role": "user", "content": args.prompt}], m.metadata.get("tokenizer.chat_template"))
    ids = tok.encode(prompt)
    print(f"\nchat prompt ({len(ids)} tokens):\n{prompt}")
    print("ids: " + " ".join(map(str, ids)))
    print("\n(text generation arrives with the forward pass; this build shows the model and tokenizer)")
    return 0


def cmd_tokenize(args) -> int:
    from .gguf_file import GGUFFile
    from .tokenizer import Tokenizer

    f = GGUFFile(args.model)
    tok = Tokenizer.from_metadata(f.metadata)
    ids = tok.encode(args.text, special=not args.no_special)
    if args.json:
        print(json.dumps(ids))
    else:
        for i in ids:
            print(f"{i:>8}  {tok.token_bytes(i)!r}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="legacy-engine", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    s = sub.add_parser("info", help="machine capabilities, chosen paths, and a model's structure")
    s.add_argument("model", nargs="?", help="a GGUF file to describe")
    s.add_argument("--json", action="store_true", help="print JSON instead of text")
    s.set_defaults(func=cmd_info)

    s = sub.add_parser("demo", help="describe and tokenize with the built-in tiny MoE model")
    s.add_argument("-p", "--prompt", default="Hello! What can a 2012 GPU still do?", help="the user message")
    s.set_defaults(func=cmd_demo)

    s = sub.add_parser("tokenize", help="token ids of TEXT with MODEL's tokenizer")
    s.add_argument("model", help="a GGUF file")
    s.add_argument("text", help="the text to tokenize")
    s.add_argument("--no-special", action="store_true", help="treat special-token text as plain text")
    s.add_argument("--json", action="store_true", help="print the ids as a JSON list")
    s.set_defaults(func=cmd_tokenize)

    # make-model and convert own their flags; they are parsed by their modules
    sub.add_parser("make-model", help="write a random-weight GGUF (make-model -h for flags)", add_help=False)
    sub.add_parser("convert", help="convert a Hugging Face checkpoint to GGUF (convert -h for flags)",
                   add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv and argv[0] == "make-model":
            from .make_model import main as make_main
            return make_main(argv[1:])
        if argv and argv[0] == "convert":
            from .convert import main as convert_main
            return convert_main(argv[1:])
        args = build_parser().parse_args(argv)
        return args.func(args)
    except EngineError as e:
        print(f"legacy-engine: error: {e}", file=sys.stderr)
        return 1
    except FileNotFoundError as e:
        print(f"legacy-engine: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("legacy-engine: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
