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
