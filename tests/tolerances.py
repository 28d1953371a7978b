"""Named tolerances for differential tests; each says why it is not zero.

Comparisons that can be exact (dequantisation, quantisation against gguf-py or a
transcription of ggml's reference) use no tolerance at all: they compare bits.
"""

# Q8_0 / Q8_1 round trip, |x - dequant(quant(x))| / amax of the block: half a step of
# d = amax/127 (0.5/127) plus d stored as fp16 (relative error <= 2^-11, times |q| <= 127);
# the 1e-5 covers the f32 roundings of amax/127, 1/d and x*(1/d). Valid while d is a normal fp16.
Q8_0_ROUNDTRIP_REL = (0.5 / 127 + 2.0**-11) * (1 + 1e-5)

# Q8_K round trip, same measure: d stays f32, so only half a step (plus f32 rounding of iscale).
Q8_K_ROUNDTRIP_REL = 0.5 / 127 * (1 + 1e-5)

# F16 round trip of values in the normal fp16 range: round to nearest, 10-bit mantissa.
F16_ROUNDTRIP_REL = 2.0**-11

# BF16 round trip of normal f32 values: round to nearest, 7-bit mantissa.
BF16_ROUNDTRIP_REL = 2.0**-8

# `legacy-engine convert` vs llama.cpp's converter, f32 values: bit-identical except ssm_a = −exp(A_log), which
# llama.cpp takes with torch's float32 exp and we with numpy's float64 exp rounded once (no torch in the engine):
# at most 1 ulp of f32, <= 2^-23 ~ 1.2e-7 relative; 1e-6 leaves room and still catches any wrong transform.
CONVERT_F32_REL = 1e-6

# ---- quantised GGUFs judged by KL against transformers on the file's dequantised weights (test_quantized.py)
# KL(p‖q) = ½·Var_p(Δlogit) + O(Δ³) ≤ ½·max|Δlogit|², so the f32 bar of oracle.md (|Δlogit| ≤ 1e-3) allows a KL of
# 5e-7 per position. Used (1) as the floor of the relative gate: below it both engines are at f32 noise and a ratio
# means nothing; (2) as the bound for our f32 path (integer kernels off), which computes in f32 on the dequantised
# weights and so must meet the f32 bar on any weight type (measured ~1e-13 mean, ~1e-12 max on the tiny tame models).
QUANT_KL_FLOOR = 0.5 * 1e-3**2

# Ours may be at most this many times further (mean / max KL over positions) from the reference than llama.cpp on
# the same file. llama.cpp quantises activations (Q8_0 for Q8_0/Q5_0 weights, Q8_K for K-quants) and measures
# 4e-5 … 2e-4 mean KL here; our integer (W4A8) path quantises the same way and measured 0.93-1.03x llama.cpp's mean
# and max; a different but equally good rounding choice (per-256 vs per-32 scales, other summation order) moves
# that by tens of %: 1.5x leaves room for it and still fails the injected bugs of the negative controls (GDN V heads
# grouped: 150-300x; top-k not renormalised: 60x; RoPE interleaved instead of NeoX on the dense model: 3-4x).
QUANT_KL_RATIO = 1.5

# Top-5 overlap (fraction of the 5·n top-5 slots shared with the reference) of ours may be this much below
# llama.cpp's. An engine that quantises activations swaps near-tied 5th/6th tokens at random: llama.cpp loses
# 13-29 of the 1000 slots of a 200-token run here, so two such engines differ by a count with SD ≈ √(2·20) ≈ 6
# slots; 0.015 (15 slots) is 2.5 SD. (Measured: our W4A8 path within 0.004 of llama.cpp, our f32 path 1.000.)
# Argmax agreement is reported, not gated (oracle.md: never gate on argmax; it flips 1-3 of 200 near-ties).
QUANT_TOP5_SLACK = 0.015

# GGUF → HF (fixtures/gguf_to_hf.py) of an f32 file against the checkpoint: everything exact but (1) norms, stored as
# fl(1+w) and read back as fl(fl(1+w) − 1): off by at most half an ulp of 1+w (2^-24 for |1+w| < 2, 2^-23 below 4)
# and (2) A_log = log(−ssm_a) with ssm_a = −exp(A_log) rounded to f32 (relative 2^-24) plus log's own rounding, for
# |A_log| ≤ 1.4: < 2^-22. Measured: 6e-8.
GGUF_TO_HF_F32_ABS = 2.0**-22

# transformers on those round-tripped weights against transformers on the checkpoint, max |Δlogit|. Measured 0:
# transformers computes 1+w from the stored w, and fl(1 + fl(fl(1+w) − 1)) = fl(1+w); exp(A_log) rounds back to the
# same f32 in the cases seen. 1e-6 allows a one-ulp flip of an A_log to reach the logits (≈ 1e-7 relative decay
# change through 8 layers) while any wrong transform (a missed −1 moves logits by O(1)) still fails.
GGUF_TO_HF_LOGITS_ABS = 1e-6

# ---- the f32 forward pass against the oracles (test_model.py)
# Our f32 logits vs transformers (f32) and vs llama.cpp (F32 KV cache) on the tiny checkpoints, max |Δ| over every
# position and vocab column: the three sum in different orders (chunked vs recurrent GDN, blocked matmuls, their own
# exp/softplus), so f32 rounding grows with the logits' scale. Measured ≤ 2.2e-4 (dense_tied, whose tied head gives
# logits of std 8) and ≤ 3.4e-5 on the other kinds; llama.cpp vs transformers ≤ 1.3e-4 (oracle.md: 1.2e-4). The
# injected bugs of the negative controls move it to ≥ 0.076, so 1e-3 separates both sides by more than 4× and 70×.
LOGIT_ABS_F32 = 1e-3

# A prefill split across several forward calls vs one call, max |Δlogit| / max |logit| (also over the decode that
# follows): each call starts its own grid of 64-token GDN chunks, so a split off that grid changes the summation
# order of the intra-chunk products (split on the grid: bit-identical, asserted separately). Measured ≤ 3.5e-6.
SPLIT_PREFILL_REL = 2e-5

# Integer dot products (tests/test_vec_dot.py), |s - s_ref| <= VEC_DOT_REL * |s_ref| + bound * M, where
# bound = VEC_DOT_ABS_PER_BLOCK * (n_blocks + VEC_DOT_EXTRA_ROUNDINGS) and M = sum_i |w_i * a_i| (for types with a
# min term, |scale part| + |min part| of each w_i, so that cancelling halves cannot hide the rounding).
# Inside a block every tier sums integers exactly; only the f32 work differs: each tier applies the block scales
# with its own rounding (d*sc rounded or not, FMA or mul+add) and sums the block terms in its own order (1, 2, 8
# or 16 lanes). Recursive f32 summation of m terms errs by at most (m-1)*u*sum|term|, u = 2^-24, plus about 3
# roundings per term (scale products, conversion, the final horizontal sum), for each of the two sides compared:
# hence 2 * 2^-24 per block plus 16 spare roundings. VEC_DOT_REL covers the last rounding of the result itself.
VEC_DOT_REL = 2.0**-22
VEC_DOT_ABS_PER_BLOCK = 2 * 2.0**-24
VEC_DOT_EXTRA_ROUNDINGS = 16
# The same bound serves ref vs f64 math on the dequantised rows (the ref's f32 rounding against none; the f32
# dequantised values carry the same few roundings per element) and ref vs llama.cpp's own generic kernels, which
# its GGML_NATIVE=OFF build compiles with -mfma: gcc contracts `sums[l] += d*aux32[l]` into FMAs, one rounding
# less per term than ggml's C text (and our ref, built with fp-contract=off) has.

# Sampler draw frequencies vs the intended distribution on a crafted 4-token distribution, 20,000 seeded draws
# (test_generate.py): the binomial standard deviation is at most sqrt(0.25 / 20000) = 0.0035, so 0.02 is > 5σ,
# while the tested mistakes are far larger: a wrong kept set draws a token that must never appear, and a
# temperature left out (T = 3 case) moves a frequency by 0.13.
SAMPLING_FREQ_ABS = 0.02

# ---- GPU kernels (cuda8/, tests/test_gpu.py), every tier against f64 math on the same inputs.
# GEMV / GEMM / int8 GEMV: Higham's bound for f32 recursive summation, |err| <= (n-1)*u*sum|term| with u = 2^-24,
# where n is the longest chain of dependent f32 additions in the kernel: the per-lane (gemv) or per-thread (gemm)
# chain of products, plus 5 levels of the warp tree (gemv). GPU_SUM_EXTRA_ROUNDINGS covers the roundings in forming
# each term: the dequantised weight by FMA (d*q - m in one rounding, the reference in two), the product with x,
# and in the int8 kernel d0*lo, d1*hi, their sum, times d8, m*s8 and the subtraction (the integer sums are exact).
# The magnitude M is taken per element as (|d*q| + |m|) * |x| (the scale part and the min part apart, so that
# cancelling halves cannot hide a rounding; as VEC_DOT above). A wrong nibble, scale or block shifts a result by
# about |w*x| of one element, i.e. ~M/n: orders of magnitude above n*u*M for every n tested (<= 4096).
GPU_SUM_U = 2.0**-24
GPU_SUM_EXTRA_ROUNDINGS = 8

# RMSNorm (rmsnorm.cu) vs le_rmsnorm done in f64, relative per element: the f32 sum of squares runs a chain of
# ncols/256 per-thread additions plus 8 tree levels (<= 40 for ncols <= 8192): relative error <= 41u; the scale
# 1/sqrt(ss/n + eps) halves it and adds 4 roundings (divide, add, sqrt, divide), then x*scale*w adds 2:
# (41/2 + 6) u = 26.5u = 1.6e-6 < 2e-6.
GPU_RMSNORM_REL = 2e-6

# quantize_q8_1.cu's s = fp16(sum of the 32 floats) vs the f64 sum: the fp16 rounding (2^-11 relative, or half the
# smallest subnormal 2^-25 absolute) plus the f32 sum's 5 tree levels (5u * sum|x|). d and qs are compared exactly.
GPU_Q8_1_SUM_REL = 2.0**-11
GPU_Q8_1_SUM_ABS = 2.0**-25
GPU_Q8_1_SUM_CHAIN = 5

# Quantised whole models on the GPU (test_gpu_model.py::test_quantized_model_on_gpu): the reference is our CPU
# engine's f32 path on the same file (integer kernels off: f32 on the dequantised rows, held to the f32 bar against
# transformers by test_quantized.py), so the GPU's f32 paths (prefill GEMM, f32 decode GEMVs) must meet
# QUANT_KL_FLOOR, and its DP4A GEMVs (activations quantised to Q8_1, 32 per block) are held to QUANT_KL_RATIO times
# the KL of our CPU integer path (proven against llama.cpp there) on the same positions, compared at the median and
# (dense models) the 90th percentile of the per-position KL (GPU_QUANT_KL_QUANTILES), not mean and max: MoE top-k
# routing turns a near-tie into a discrete jump, and the recurrent state carries it to later positions (measured on
# the moe Q4_0 file: one position at KL 1.2e-2 and an elevated tail after it, p90 9.0e-5 against the CPU's 5.9e-5,
# while the median is 3.4e-5 against 3.6e-5; the CPU path flips elsewhere, KL max 1.4e-3). Two equally accurate
# engines flip at different positions, so on MoE models mean, max and upper quantiles compare luck; the median
# compares the kernels' continuous error (the injected bugs of test_quantized move KL 3-300x at every position and
# fail it). Top-5: 128 positions are 640 slots; two engines that each swap ~2 % of near-tied 5th/6th slots at
# random differ by SD ~ sqrt(2*13) ~ 5 slots; 2.5 SD = 13 slots = 0.02 -> 0.025.
GPU_QUANT_KL_QUANTILES = (0.5, 0.9)
GPU_QUANT_TOP5_SLACK = 0.025

# ---- f32 kernels of the decode step (tests/test_f32_kernels.py), every tier against f64 math.
# GDN step (one head): delta_c = beta (v_c - sum_i decay S_ic k_i) is a chain of dk f32 additions, so its error is
# at most (dk + 4) u Md_c with Md_c = |beta| (|v_c| + sum_i |decay S_ic k_i|) (Higham, u = 2^-24, 4 roundings to
# form it); S'_ic = decay S_ic + k_i delta_c adds 3 roundings of decay |S_ic| and |k_i| times delta's error; o_c is
# another chain of dk terms over S' (or, in the SIMD tiers, decay S^T q + (k.q) delta: two chains of dk). Hence per
# element |err| <= GDN_STEP_CHAIN * (dk + GDN_STEP_EXTRA) * u * M with M the sum of absolute terms of that element
# (S': decay |S_ic| + |k_i| Md_c; o: sum_i |q_i| M(S'_ic) + |k.q| Md_c). A kernel that drops, repeats or swaps a
# row or column moves an element by about M / dk, more than 100x the bound at dk <= 256.
GDN_STEP_CHAIN = 2
GDN_STEP_EXTRA = 8
# f32 dot product: a chain of at most n additions per lane plus the lane reduction: (n + 8) u sum |a_i b_i|.
DOT_F32_EXTRA = 8

# ---- the sampler (native/sample.c) against the float64 numpy reference of tests/test_sampling.py
# A weight is exp(arg), arg = (x - max) / T: float exp within 1.2e-7 relative (Cephes' expf, measured on every float in
# [-87.3, 0]) of an argument rounded to float up to three times (x - max, 1/T, the product: 3 * 2^-24 = 1.8e-7 of
# |arg|). A probability w_i / W adds the same for W (a weighted mean over the kept tokens, summed in double):
#   |p_i - p_ref_i| <= SAMPLING_W_REL * (2 + |arg_i| + sum_j p_ref_j |arg_j|) * p_ref_i + SAMPLING_FLUSH_ABS
# SAMPLING_W_REL = 2e-7 covers 1.2e-7 per exp and 1.8e-7 per unit of |arg|. Measured: 6.3e-6 relative at most (|arg|
# near 87 on logits of std 8), 1e-6 at |arg| ~ 5. A wrong temperature, a token too many or too few moves a
# probability by far more (the negative controls).
SAMPLING_W_REL = 2e-7
# arg below ln(FLT_MIN) = -87.34: the float exp gives 0 where float64 gives at most FLT_MIN of the max (2x margin).
SAMPLING_FLUSH_ABS = 2.0**-125
# top-p compares running masses of those float weights (T = 1, at most 2 roundings of x - max: 2.4e-7 + 6e-8 |arg|
# relative each) with top_p * S: the kept set may differ from the reference's only where the reference's running
# mass fraction lies this close to top_p (tokens of up to |arg| = 80 near the cut). The fixed seeds of the tests
# never come that close (kept sets identical in every case), so this bounds a flake, not a measured difference.
SAMPLING_CUT_MASS_REL = 1e-5
# The draw inverts u * W over float weights summed per block of 256 in float (32 additions a lane: up to 1.9e-6 of
# W), then in double: the token may differ from the reference's inversion only where u lies this close (as a
# fraction of the mass) to a running sum of the reference's probabilities.
SAMPLING_DRAW_ABS = 1e-5

# The masses of cuda8/sample_cut.cu (Z, the mass before a window, the running mass at a bin) against float64, as a
# fraction of the row's mass: fixed point of 2^-40 (2^-41 per token: 1.1e-7 at 248k tokens) of expf's value (2 ulp
# per token: 2.4e-7 of each mass).
SAMPLE_MASS_REL = 5e-7

# ---- the vision tower (tests/test_vision_tower.py; spec §2.7) ------------------------------------------------------
# The tower's ops (LayerNorm, both GELUs, the 2-D RoPE, bidirectional attention, the position-grid interpolation)
# in f32 against a float64 numpy transcription: each output is a handful of f32 roundings (libm's tanhf/erff/
# cosf/sinf/expf within ~1 ulp; sums in double or of short rows), so a few ulps of max(|ref|, 1): 16 · 2^-24 ≈ 1e-6.
VISION_OP_REL = 16 * 2.0**-24

# Bidirectional attention (le_vision_op_attention) against float64 numpy, relative to max(|ref|, 1): each score is a
# head_dim-term f32 dot product (|q·k| up to ~30 for the test's inputs of std 2), whose rounding (~1e-6 absolute)
# becomes a relative error of the softmax weights; measured 1.9e-6; 1e-5 leaves ~5x.
VISION_ATTN_REL = 1e-5

# Merged embeddings (|y| ≈ 2.5) of the f32 tower against transformers' Qwen3_5VisionModel in f32 on the same
# weights (for an F16 mmproj: transformers on the f16-rounded weights, which our f32 path dequantises exactly).
# Both compute every step in f32; only summation orders and libm-vs-Sleef transcendentals differ: measured max |Δ|
# 1.3e-6 … 3.2e-6 on the tiny towers (grids up to 8 x 10 and real images). llama.cpp leaves ~1e-2 (spec §2.7: its f16
# GELU table); 2e-5 keeps ~6x room over the measured and stays ~20x below the smallest injected bug (the GELU in the
# wrong form in one place: 3.6e-4 … 4.6e-4; position grid not interpolated, RoPE rows/columns swapped: 0.4 … 0.9).
VISION_F32_ABS = 2e-5

# ---- the vision tower on the GPU (tests/test_gpu_vision.py) ---------------------------------------------------------
# layernorm.cu against float64 numpy, relative to max(|ref|, 1): the mean and the sum of squared deviations are f32
# per-thread sums added as a tree (the reference sums in f64); with the test's offset mean (20 + 3 N(0, 1)) the mean's
# rounding (a few ulps of 20) is what shows, ~1e-6 of the unit-scale output. 1e-5 leaves room for 4608-wide rows.
GPU_LAYERNORM_REL = 1e-5

# gelu.cu (tanh and erf forms, bias folded in) against the C core's le_gelu_*_ref on the same f32 input, relative to
# max(|ref|, 1): CUDA's tanhf / erff (<= 2 ulp) against libm's (~1 ulp), and the polynomial's products contracted to
# FMA on the GPU: a few ulps, as VISION_OP_REL.
GPU_VISION_GELU_REL = 16 * 2.0**-24

# attention_bidir.cu against float64 numpy, relative to max(|ref|, 1): the scores are hd-term f32 dot products summed
# in one sequential chain per lane (|q.k| / sqrt(hd) up to ~15 at the test's std 2: their rounding, ~1e-6 of a score,
# moves the peaked softmax's weights by as much), then the online softmax's per-tile rescales and o = acc / l at the
# end (the reference normalises first and sums in f64). Measured (H200, every tier the same): 3.9e-6 (hd 32),
# 8.0e-6 (hd 72), 1.6e-5 (784 keys, hd 64), 1.3e-5 (hd 256); at std 1 all <= 8e-7. The CPU op on the same inputs:
# up to 5.2e-6. 5e-5 leaves ~3x.
GPU_ATTN_BIDIR_REL = 5e-5

# GpuVisionTower against the CPU VisionTower (native/vision.c) on the same weights, relative to max(|ref|, 1) (|y| of a
# few tenths to ~3): both f32 throughout; the GEMMs sum in another order (gemm_f32's k order vs le_matmul's SIMD
# lanes), the norms' and the softmax's sums in f32 trees (the CPU's in f64), CUDA's tanhf/erff/expf vs libm. Measured
# (H200, tests/test_gpu_vision.py's random towers, fermi-sm35 and dp4a-sm90 alike): 1.8e-6 … 2.9e-6 (depth 2, hidden
# 64 and 288 with head size 72 and F16 matrices), 6.6e-6 (one real-size layer: hidden 768, ffn 3072, 28 x 28). The
# GELU in the wrong form in one place (the CPU tower's injected faults) moves the output by 2.4e-4 … 5.9e-4, so 3e-5
# keeps ~5x over the measured and ~8x below the smallest such bug.
GPU_VISION_TOWER_REL = 3e-5

# ---- llama.cpp's mtmd as the second reference for the CPU vision tower (tests/test_vision_mtmd.py) -----------------
# Merged embeddings of the CPU tower against llama.cpp's mtmd (llama-cpp-python 0.3.36) on the same mmproj and image
# (sizes neither engine resizes), max |Δ| relative to the embeddings' scale (max |y| of transformers' output,
# 2.3 … 2.4).
# llama.cpp's CPU path computes GELU from an f16 lookup table (tanh form, also in the merger where transformers uses
# erf) and takes other f16-sized steps (spec §2.7), so it sits ~6e-4 of the scale from transformers while we sit ~1e-6;
# measured ours vs mtmd on the dense tiny tower: 5.3e-4 … 6.1e-4 (f32 mmproj), 5.6e-4 … 6.4e-4 (f16), images 256x256,
# 320x256, 512x384. 3e-3 keeps ~5x over that; the position-grid and RoPE bugs (0.17 … 0.44 of the scale) fail it by
# far, the GELU-in-the-wrong-form bugs (1.6e-4 … 1.9e-4 from transformers) do not: that is VISION_F32_ABS's job
# (tests/test_vision_tower.py, against transformers).
MTMD_VISION_REL = 3e-3

# f32 gemm tile kernel (le_simd.h gemm_tile; tests/test_f32_kernels.py), per element against f64 math: each C element
# is one dot product of K terms, summed in 8 (ref) or 8/16 (SIMD) lane chains of at most K / lanes additions then a
# reduction tree of 3-4 levels: |err| <= (K + GEMM_TILE_F32_EXTRA) u sum_k |a_ik b_jk|, as DOT_F32_EXTRA (16: the 16
# lanes' tree plus the masked tail). Measured on random N(0, 1) operands: <= 0.63 of (K u M). A SIMD tier against the
# scalar reference: both within that bound of the exact sum, so within twice it of each other.
GEMM_TILE_F32_EXTRA = 16

# ---- llama.cpp's time to first token beside ours (tests/test_bench_vision.py) --------------------------------------
# The last position's logits of an image question (the same prompt text and PNG, 448x448: both engines keep its 196
# tokens), ours against llama.cpp's (LlamaChat: mtmd encode, llama_decode of the chunks), max |Δ| / max |logit| on the
# dense tiny model with an F16 mmproj: the gap is mtmd's tower error (MTMD_VISION_REL: its f16 GELU table) carried
# through the LM. Measured 8.6e-4 and 9.8e-4 (image seeds 0 and 3; the same with llama.cpp's KV cache in F32 as in
# its default F16); another image on llama.cpp's side (seed 1 vs 0) gives 7.9e-2. 3e-3 keeps ~3x over the measured
# and ~25x below a wrong image.
MTMD_TTFT_LOGITS_REL = 3e-3

# gemm_nn (le_simd.h; tests/test_f32_kernels.py), per element against f64 math: each C element is one FMA chain per
# block of LE_GEMM_NN_KB = 128 k's, the block sums added in order (the reference: the same order, unfused), so a
# product passes through at most min(K, 128) + K / 128 roundings (its own included where unfused), never more than
# K + 2: |err| <= (K + GEMM_NN_F32_EXTRA) u sum_k |a_ik b_jk|. Measured on N(0, 1) operands: <= 0.40 of (K u M)
# (K = 1: one rounding), <= 0.16 for K >= 7.
GEMM_NN_F32_EXTRA = 2

# exp_sub_sum (le_simd.h; tests/test_f32_kernels.py): each SIMD tier's y = exp(x scale - max scale) against the
# reference's glibc expf on the same argument, in units in the last place (the f32 bit patterns' distance, which
# counts subnormal steps as ulps too). The vector expf (cpu_simd/simd_x86.h: Cephes' polynomial, FMA range reduction)
# measured max 1 ulp, mean 0.05, over 300k points of [-110, 0] and random rows at scales 1/8 and 1/sqrt(72); 2
# leaves room for a libm whose expf is itself ~1 ulp off. Below -104 and at -inf both give exactly 0.
EXP_SUB_SUM_ULP = 2
# silu (le_simd.h; x / (1 + exp(-x)) with that vector expf): against the reference's libm form and against f64, in
# ulps of the f32 bit patterns: exp's <= 2 ulps plus the add's and the divide's roundings. Below x = -88.7 exp(-x)
# overflows f32 and this form (the reference too) gives -0, not the tiny true value: the test checks that apart.
# Measured over [-88.5, 120] (400k points): 3 ulps from the reference, 2 from f64, on AVX2 and AVX-512.
SILU_ULP = 4
