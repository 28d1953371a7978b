"""Keeps cuda8/ inside what CUDA 8 (C++11, sm_20) accepts; CUDA 8 itself cannot be installed here.

Rules (comments and string literals are ignored):
* outside compat.cuh: no *_sync intrinsics or __syncwarp/__activemask, no __shfl*, no __ldg, no __dp4a,
  no __CUDA_ARCH__ / __CUDACC_VER_* (tiers are named in compat.cuh), no __half / half2 / __h* arithmetic
  and no cuda_fp16.h;
* anywhere: no cooperative groups, no C++14 that is cheap to spot (auto return type deduction,
  decltype(auto), generic lambdas, lambda init-captures, variable templates, binary literals, digit
  separators, [[deprecated]], constexpr functions with loops or several statements, make_unique);
* static __shared__ arrays (LE_SCRATCH included) of each kernel <= 48 KB (an upper bound: the arrays in its body,
  the largest branch of an #if/#else, plus any outside the kernels).

Run: python tests/lint_cuda8.py [files]; tests/test_gpu.py runs it on cuda8/.
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CUDA_DIR = ROOT / "cuda8"
COMPAT = "compat.cuh"
SHARED_LIMIT = 48 * 1024

SIZEOF = {"float": 4, "int": 4, "unsigned": 4, "uint32_t": 4, "int32_t": 4, "double": 8, "int64_t": 8,
          "uint64_t": 8, "short": 2, "int16_t": 2, "uint16_t": 2, "char": 1, "int8_t": 1, "uint8_t": 1,
          "float2": 8, "float4": 16, "int2": 8, "int4": 16, "block_q8_1": 36, "block_q8_0": 34,
          "le_u64": 8}   # le_u64: sample_cut.cu's unsigned long long (the 64-bit atomics' type)

# (regex, message, allowed in compat.cuh)
RULES = [
    (r"\b__\w+_sync\s*\(|\b__syncwarp\b|\b__activemask\b", "*_sync / warp-sync intrinsic (CUDA 9+)", True),
    (r"\b__shfl\w*", "warp shuffle (sm_30+; use le_shfl_xor)", True),
    (r"\b__ldg\b", "__ldg (sm_35+; use le_ldg)", True),
    (r"\b__dp4a\b", "__dp4a (sm_61+; use le_dp4a)", True),
    (r"\b__CUDA_ARCH__\b|\b__CUDACC_VER_\w+", "raw arch / compiler version test (name it in compat.cuh)", True),
    (r"\b__half2?\b|\bhalf2\b|\b__h(add|sub|mul|div|fma|neg)2?\b|cuda_fp16\.h", "__half arithmetic (sm_53+)", True),
    (r"cooperative_groups", "cooperative groups (CUDA 9+)", False),
    (r"\bdecltype\s*\(\s*auto\s*\)", "decltype(auto) (C++14)", False),
    (r"\[[^\[\]]*\]\s*\([^()]*\bauto\b", "generic lambda (C++14)", False),
    (r"\[[^\[\]]*\b\w+\s*=\s*[^\]=,]+\]\s*\(", "lambda init-capture (C++14)", False),
    (r"template\s*<[^<>]*>\s*(constexpr\s+)?[\w:]+\s+\w+\s*=", "variable template (C++14)", False),
    (r"\b0[bB][01]+", "binary literal (C++14)", False),
    (r"\d'\d", "digit separator (C++14)", False),
    (r"\[\[\s*deprecated", "[[deprecated]] (C++14)", False),
    (r"\bmake_unique\b", "std::make_unique (C++14)", False),
]

# `auto name(args) {` or `auto name(args) const {` without a trailing return type
AUTO_RETURN = re.compile(r"\bauto\s+[\w:]+\s*\(([^()]|\([^()]*\))*\)\s*(const\s*)?(noexcept\s*)?\{")
CONSTEXPR_FN = re.compile(r"\bconstexpr\b[^;{}=]*\([^;{}]*\)\s*(const\s*)?\{")


def strip(text: str) -> str:
    """Comments and string/char literals blanked (newlines kept, so line numbers hold)."""
    def blank(m):
        return re.sub(r"[^\n]", " ", m.group(0))
    return re.sub(r'//[^\n]*|/\*.*?\*/|"(\\.|[^"\\\n])*"|\'(\\.|[^\'\\\n])+\'', blank, text, flags=re.S)


def _line(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def _body(text: str, open_brace: int) -> str:
    depth = 0
    for i in range(open_brace, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[open_brace + 1:i]
    return text[open_brace + 1:]


def _eval_dim(expr: str, macros: dict[str, str]) -> int | None:
    for _ in range(10):   # expand macros (nested ones too)
        new = re.sub(r"\b[A-Za-z_]\w*\b", lambda m: f"({macros[m.group(0)]})" if m.group(0) in macros else m.group(0),
                     expr)
        if new == expr:
            break
        expr = new
    if not re.fullmatch(r"[\d\s()+\-*/%]+", expr):
        return None
    try:
        return int(eval(expr.replace("/", "//"), {"__builtins__": {}}))
    except (SyntaxError, ZeroDivisionError):
        return None


def _shared_decls(text: str, macros: dict[str, str]) -> tuple[list[tuple[int, int]], list[str]]:
    """(position, bytes) of each static __shared__ array declared in text (LE_SCRATCH(name, n) = float[n])."""
    found, problems, out = [], [], []
    for m in re.finditer(r"__shared__\s+(?:__align__\s*\(\s*\d+\s*\)\s+)?(?:volatile\s+)?(\w+)\s+\w+((?:\s*\[[^\]]+\])+)\s*;",
                         text):
        out.append((m.group(1), re.findall(r"\[([^\]]+)\]", m.group(2)), m.start()))
    for m in re.finditer(r"\bLE_SCRATCH\s*\(\s*\w+\s*,\s*([^)]+)\)", text):
        out.append(("float", [m.group(1)], m.start()))
    for typ, dims, pos in out:
        if "define LE_SCRATCH" in text[max(0, pos - 40):pos + 12]:
            continue
        size = SIZEOF.get(typ)
        n = 1
        for d in dims:
            v = _eval_dim(d, macros)
            n = None if v is None or n is None else n * v
        if size is None or n is None:
            problems.append(f"line {_line(text, pos)}: cannot size __shared__ {typ}[{']['.join(dims)}]")
            continue
        found.append((pos, size * n))
    return found, problems


def kernel_shared(text: str, macros: dict[str, str]) -> tuple[dict[str, int], list[str]]:
    """Static __shared__ bytes per __global__ kernel of text: the arrays in its body, where the branches of an
    #if/#elif/#else take the largest (one branch is compiled), plus every array outside the kernels (file scope,
    device functions: counted for each kernel, an upper bound). {'': file total} when text has no kernel."""
    decls, problems = _shared_decls(text, macros)
    spans = []
    for m in re.finditer(r"__global__\s+void\s+(\w+(?:\s*##\s*\w+)*)\s*\(", text):   # a macro's name##suffix too
        brace = text.index("{", m.end())
        spans.append((m.group(1), brace, brace + 1 + len(_body(text, brace))))
    inside = {pos for pos, _ in decls for _, a, b in spans if a < pos < b}
    outside = sum(b for pos, b in decls if pos not in inside)
    if not spans:
        return {"": outside}, problems
    out = {}
    for name, a, b in spans:
        events = [(pos, "decl", size) for pos, size in decls if a < pos < b]
        for m in re.finditer(r"^\s*#\s*(if|ifdef|ifndef|elif|else|endif)\b", text[a:b], flags=re.M):
            events.append((a + m.start(), m.group(1), 0))
        stack = [[0]]          # per open #if: the bytes of each of its branches so far
        for _pos, kind, size in sorted(events):
            if kind == "decl":
                stack[-1][-1] += size
            elif kind in ("if", "ifdef", "ifndef"):
                stack.append([0])
            elif kind in ("elif", "else") and len(stack) > 1:
                stack[-1].append(0)
            elif kind == "endif" and len(stack) > 1:
                largest = max(stack.pop())
                stack[-1][-1] += largest
        while len(stack) > 1:
            largest = max(stack.pop())
            stack[-1][-1] += largest
        out[name] = stack[0][0] + outside
    return out, problems


def shared_bytes(text: str, macros: dict[str, str]) -> tuple[int, list[str]]:
    """The largest kernel's static __shared__ bytes in text (kernel_shared), and what could not be sized."""
    per, problems = kernel_shared(text, macros)
    return max(per.values()), problems


def _macros(text: str) -> dict[str, str]:
    return dict(re.findall(r"^\s*#\s*define\s+(\w+)\s+([^\n]+)$", text, flags=re.M))


def lint_text(name: str, raw: str, header_text: str = "") -> list[str]:
    """Problems of one file; header_text: the (stripped) headers whose macros are in scope."""
    text = strip(raw)
    is_compat = name == COMPAT
    out = []
    for pattern, msg, compat_ok in RULES:
        if compat_ok and is_compat:
            continue
        for m in re.finditer(pattern, text):
            out.append(f"{name}:{_line(text, m.start())}: {msg}: {m.group(0).strip()!r}")
    for m in AUTO_RETURN.finditer(text):
        out.append(f"{name}:{_line(text, m.start())}: auto return type deduction (C++14)")
    for m in CONSTEXPR_FN.finditer(text):
        body = _body(text, m.end() - 1)
        if re.search(r"\b(for|while|do|switch)\b", body) or body.count(";") > 1:
            out.append(f"{name}:{_line(text, m.start())}: constexpr function with more than a return (C++14)")
    per, problems = kernel_shared(text, _macros(header_text + "\n" + text))
    out += [f"{name}: {p}" for p in problems]
    for kernel, total in per.items():
        if total > SHARED_LIMIT:
            out.append(f"{name}: {kernel or 'file scope'}: {total} bytes of static __shared__ arrays > 48 KB")
    return out


def headers_text() -> str:
    return "\n".join(strip(h.read_text(encoding="utf-8")) for h in sorted(CUDA_DIR.glob("*.cuh")))


def shared_report() -> dict[str, int]:
    """Static __shared__ bytes of each cuda8 file's largest kernel (kernel_shared)."""
    hdr = headers_text()
    return {p.name: shared_bytes(strip(p.read_text(encoding="utf-8")), _macros(hdr + "\n" + strip(p.read_text(encoding="utf-8"))))[0]
            for p in sorted(CUDA_DIR.glob("*.cu"))}


def lint(paths=None) -> list[str]:
    paths = sorted(CUDA_DIR.glob("*.cu")) + sorted(CUDA_DIR.glob("*.cuh")) if paths is None else [Path(p) for p in paths]
    hdr = headers_text()
    out = []
    for p in paths:
        out += lint_text(p.name, p.read_text(encoding="utf-8"), hdr)
    return out


def main(argv=None) -> int:
    problems = lint((argv or sys.argv[1:]) or None)
    for p in problems:
        print(p)
    print(f"{len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
