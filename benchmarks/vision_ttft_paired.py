"""Time to first token of an image question, ours and llama.cpp's run by run in turn, for a shared machine.

`legacy-engine bench vision --text T --llama T` times every run of ours, then every run of llama.cpp's: on a box
whose other work comes and goes (the 2-core dev box) the two sides then see different loads. Here both models are
loaded once in one process and the runs alternate (the order swapped each round), so each pair sees about the same
load. The runs are bench_vision's own (ttft_once, LlamaChat.ttft_once: the same rendered prompt and PNG bytes); one
warm-up pair per size is dropped.

    python benchmarks/vision_ttft_paired.py TEXT.gguf MMPROJ.gguf [--sizes 448x448,1024x1024] [--rounds 4,3]
                                            [--threads 2] [--json OUT.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))   # run from a checkout without installing

from legacy_engine.serve.generate import Engine  # noqa: E402
from legacy_engine.tools import bench_vision as bv  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("text", help="text GGUF (both engines)")
    ap.add_argument("mmproj", help="its mmproj GGUF")
    ap.add_argument("--sizes", default="448x448,1024x1024", help="synthetic image sizes WxH,... (seed 0)")
    ap.add_argument("--rounds", default="4,3", help="timed pairs per size (one number, or one per size)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    sizes = [tuple(int(v) for v in s.split("x")) for s in a.sizes.split(",")]
    rounds = [int(r) for r in a.rounds.split(",")]
    rounds = rounds * len(sizes) if len(rounds) == 1 else rounds

    eng = Engine(a.text, n_threads=a.threads, mmproj=a.mmproj, pin=False)
    prompt, ids = bv.image_question(eng)
    pngs = [bv.png_bytes(bv.synthetic_rgb(w, h, 0)) for w, h in sizes]
    llama, text = bv.open_llama_chat(a.mmproj, a.text, a.threads, prompt, pngs)
    sides = {"ours": lambda png: bv.ttft_once(eng, ids, png), "llama.cpp": lambda png: llama.ttft_once(text, png)}
    out = []
    try:
        for (w, h), png, n in zip(sizes, pngs, rounds):
            for run in sides.values():
                run(png)                            # warm-up pair: dropped
            runs = {name: [] for name in sides}
            for r in range(n):
                for name in (sides if r % 2 == 0 else reversed(list(sides))):
                    runs[name].append(sides[name](png))
                    print(f"  {w}x{h} {name} round {r}: {sum(runs[name][-1][0]):.2f} s, load {os.getloadavg()[0]:.2f}",
                          file=sys.stderr, flush=True)
            rows = {name: bv._ttft_row(f"{w}x{h}", *rs[-1][1:3], [x[0] for x in rs], rs[-1][3])
                    for name, rs in runs.items()}
            out.append(rows)
            for name, r in rows.items():
                print(f"{w}x{h} {name:>9}: {r['prompt_tokens']} tokens ({r['image_tokens']} image), ttft median "
                      f"{r['ttft_median_s']:.2f} s (min {r['ttft_min_s']:.2f}) = preprocess {r['preprocess_s']:.3f} + "
                      f"encode {r['encode_s']:.2f} + prefill {r['prefill_s']:.2f}; first token {r['first_token']}")
            o, ll = rows["ours"], rows["llama.cpp"]
            print(f"{w}x{h} ours/llama.cpp: ttft {o['ttft_median_s'] / ll['ttft_median_s']:.2f}, encode "
                  f"{o['encode_s'] / ll['encode_s']:.2f}, prefill {o['prefill_s'] / ll['prefill_s']:.2f}")
    finally:
        llama.close()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(text=a.text, mmproj=a.mmproj, threads=a.threads, prompt=prompt, rows=out), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
