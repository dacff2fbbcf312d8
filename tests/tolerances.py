"""Every accuracy tolerance of the test suite, in one table, each with its reason.

Module-level accuracy is SQNR (dB) against float64 (DESIGN.md); bounds are the measured value
minus a stated margin, so that a format one notch coarser, or a broken reference path, fails.
Exactness checks (bit equality, assert_close on exact arithmetic) stay beside their tests.
Sections are named by the test file that reads them.
"""

from __future__ import annotations

# ---- test_linear.py ------------------------------------------------------------------------
# SQNR floors (dB) of y / dx / dw against the unquantized layer in float64, on Gaussian data
# (x ~ N(0,1) [256,256], w ~ N(0,1/256) [128,256], dy ~ N(0,1)); measured values sit 2-4 dB higher.
# Under DGE, dw is compared with the exact dw times the same f'(w) (DGE rescales dw on purpose:
# against the plain dw it keeps ~2.5 dB, which an all-zero dw, 0 dB, would nearly match).
RECIPE_SQNR_FLOORS = {
    # e4m3 operands ~31 dB; the e5m2 gradient (2 mantissa bits) limits dgrad/wgrad to ~25 dB.
    "fp8-tensorwise": (29.0, 22.0, 22.0),
    # e4m3 everywhere with per-row scales: backward ~29 dB.
    "fp8-rowwise": (29.0, 26.0, 26.0),
    # 1x128 / 128x128 tiles behave like rowwise at these sizes.
    "fp8-blockwise": (29.0, 26.0, 26.0),
    # first step of delayed scaling = tensorwise (empty history -> current amax).
    "fp8-delayed": (29.0, 22.0, 22.0),
    # E2M1 x E2M1 ~20 dB; dw against exact dw * f'(w): ~18.6 dB.
    "fp4": (17.0, 16.0, 16.0),
    # W4A4 direct cast: ~19.5 / 18 / 18 dB.
    "fp4-direct": (17.0, 16.0, 16.0),
    "fp4-dge": (17.0, 16.0, 16.0),  # DGE on wgrad as in fp4: dw ~18.0 dB
    "fp4-occ": (17.0, 16.0, 16.0),  # clamping Gaussian tails at 0.99 costs nothing visible
    # one 8-bit operand: fprop ~22 dB; the 8-bit operand's backward GEMM ~24.7 dB.
    "fp4-w4a8": (19.5, 16.0, 22.0),
    "fp4-w8a4": (19.5, 22.0, 16.0),
    "fp4:occ.compensation_format=fp32": (17.0, 16.0, 16.0),  # as fp4
    "fp4-occ:scaling.input=tensor": (17.0, 16.0, 16.0),  # as fp4-occ
    "fp8-blockwise:occ=on": (29.0, 26.0, 26.0),  # as fp8-blockwise
    "fp4:occ.one_gemm=off": (17.0, 16.0, 16.0),  # as fp4
    # E2M1 in 1x16 blocks (E4M3 x fp32 scales) and 16x16 weight blocks: y ~19.9, dx / dw ~16.7
    # / 17.5 dB; stochastic rounding of dy costs ~1.7 dB of dx and dw (a larger error, unbiased).
    "nvfp4": (18.0, 13.0, 13.5),
    "nvfp4:rht=off:sr=off": (18.0, 14.5, 15.5),
    # 1x32 blocks with power-of-two scales: y ~19.0, dx / dw ~15.9 dB, with SR ~14.0 dB.
    "mxfp4": (17.0, 12.0, 12.0),
    "mxfp4:sr=off": (17.0, 14.0, 14.0),
    # power-of-two scales: FP8 within 0.2 dB of fp32 scales on Gaussian data; E2M1 loses ~1 dB
    # of y and ~1.3 dB of dx (the row's largest entry no longer lands on 6 exactly).
    "fp8-tensorwise:scale_format=pow2": (29.0, 22.0, 22.0),
    "fp8-rowwise:scale_format=pow2": (29.0, 26.0, 26.0),
    "fp4:scale_format=pow2": (16.0, 15.0, 16.0),  # dw ~18.6 dB
}
# fp32 scales quantize as "inv" scales do but where x / scale lies within an ulp of a rounding
# boundary: the base recipes' floors.
RECIPE_SQNR_FLOORS.update(
    {f"{base}:scale_format=fp32": RECIPE_SQNR_FLOORS[base]
     for base in ("fp8-tensorwise", "fp8-rowwise", "fp8-blockwise", "fp4-dge", "fp4")}
)  # fmt: skip

# ---- test_quantize.py ----------------------------------------------------------------------
# Per-row fake quantization of Gaussian data, SQNR floors (dB) with ~2-4 dB of margin.
FAKE_QUANTIZE_SQNR_FLOOR_DB = {
    "e2m1": 12.0,  # 4-bit float: ~15 dB on Gaussians
    "e4m3": 28.0,  # 3 mantissa bits: ~31 dB
    "e5m2": 22.0,  # 2 mantissa bits: ~25 dB
    "int8": 35.0,  # 127 uniform levels over the row's range: ~38 dB
}

# ---- test_sqnr.py --------------------------------------------------------------------------
# Margins (dB) for the demo's orderings on 256 x 512 tensors (measured gaps in brackets).
SQNR_TABLE_MARGIN_DB = {
    "row_over_tensor": 3.0,  # E2M1 scales adapt to row norms / token magnitudes [6.2-6.9]
    "fp8_over_fp4": 6.0,  # E4M3 has 2 more mantissa bits than E2M1, ~12 dB [12.6-19.1]
    "block_over_row": 0.5,  # E2M1 1x32 blocks confine outliers better than rows [0.95-8.9]
}

# ---- test_hopper_linear.py -----------------------------------------------------------------
# Relative error bound (Frobenius) of hopper outputs against emulated ones, one reason each.
HOPPER_VS_EMULATED_RTOL = {
    "y": 1e-2,  # bf16 output: a different fp32 summation order can flip one bf16 rounding
    "dx": 1e-2,  # bf16 output, same reason
    # fp32 output, but Hopper's FP8 MMAs accumulate with ~14 mantissa bits before promoting to
    # fp32, where the emulation sums in fp32 (measured ~1e-4 relative on an H200).
    "dw": 5e-4,
}

# ---- test_hopper_block.py ------------------------------------------------------------------
# A compiled block's gradients against the unquantized eager block's may be at most this much
# worse (SQNR, dB) than the same recipe's eager gradients: both carry the recipe's quantization
# error, and compiled and eager differ only where a fused kernel rounds an entry to the other
# side of a grid point. Measured gaps: on the CPU at small width (dim 256, 2 x 128 tokens) at
# most 0.35 dB (nvfp4's attention-norm weight; fp8-tensorwise 0.24 dB, fp4 0.01 dB); on an H200
# at 125M and 1.3B width, every recipe, at most 0.18 dB (nvfp4's attention-norm weight at 125M;
# 0.14 dB at 1.3B; `gpu_tests_h200_2026-11-29_s48_sqnr_gaps.md`, session 48). A lost scale or a
# wrong operand costs far more.
COMPILED_BLOCK_SQNR_MARGIN_DB = 0.5

# ---- test_scaled_mm.py ---------------------------------------------------------------------
# Error bounds of float GEMMs (relative Frobenius error against float64), one reason each.
SCALED_MM_RTOL = {
    # FP8 products are exact, but Hopper's tensor cores add them with ~14 mantissa bits inside
    # each MMA before promoting to fp32 (measured ~1e-4 relative at K=272 on an H200).
    "rowish": 5e-4,
}

# ---- test_optim.py -------------------------------------------------------------------------
# Minimum SQNR (dB) of one encode/decode round trip, per state format, on the test's data
# (heavy-tailed, squared for the sqrt-domain formats): measured minus ~3 dB, so that a format
# one notch coarser fails.
STATE_CODEC_SQNR_DB = {
    "fp32": 200.0,  # stored as is
    "bf16": 53.0,  # 8-bit significand: measured 55.9
    "fp16": 72.0,  # 11-bit significand, block scale keeps values normal: measured 75.8
    "fp8": 31.0,  # e4m3 with a scale per 128 elements: measured 34.0
    "fp8-sr": 28.0,  # stochastic rounding: more error variance, unbiased; measured 31.0-31.2
    # the stored sqrt halves the dynamic range a block scale must cover, which outweighs the
    # doubled relative error of squaring it back on this data: measured 39.7 and 35.8-37.1
    "fp8-sqrt": 36.5,
    "fp8-sqrt-sr": 32.5,
}

# Minimum SQNR (dB) of parameters after 20 AdamW steps with (exp_avg, exp_avg_sq) formats
# against fp32 states: measured minus ~3 dB.
STATE_TRAJECTORY_SQNR_DB = {
    ("bf16", "bf16"): 50.0,  # state rounding ~2^-9 per step; measured 53.0
    ("fp16", "fp16"): 68.0,  # measured 71.1
    ("fp8", "fp16"): 26.5,  # the fp8-fp16 preset; m in e4m3 enters every update: 29.6
    ("fp8", "fp8"): 26.0,  # measured 29.0
    ("fp8", "fp8-sqrt"): 25.0,  # measured 27.9
    ("fp8-sr", "fp8-sqrt-sr"): 21.5,  # measured 24.7
}

# ---- test_distributed.py -------------------------------------------------------------------
# Minimum SQNR (dB) of a reduction against the fp32 all-reduce, per (kind, fp8 format).
ALLREDUCE_SQNR_DB = {
    ("fp32", "e4m3"): 140.0,  # same collective as the reference: exact
    ("bf16", "e4m3"): 40.0,  # 8-bit mantissa, one rounding per rank plus bf16 sums
    ("fp8", "e4m3"): 24.0,  # 3-bit mantissa, two roundings (send, then reduced chunk)
    ("fp8", "e5m2"): 18.0,  # 2-bit mantissa, two roundings
}

# Minimum SQNR (dB) of DDP-averaged gradients against single-process full-batch gradients.
DDP_GRAD_SQNR_DB = {
    # At the same point only the summation order differs (fp32 rounding is ~140 dB): measured
    # >= 134 dB over 112 model/batch seeds, with AVX2 and with scalar kernels.
    "fp32": 100.0,
    "bf16": 35.0,  # bf16 payloads
    "fp8": 18.0,  # fp8 payloads with a shared scale per bucket (small grads lose bits)
}

# Minimum SQNR (dB) of each parameter's change (p - p0) after a few AdamW steps, between two
# runs whose gradients differ only in summation order. No elementwise bound holds: AdamW scales
# each element's step to ~lr whatever the gradient's size, so where a gradient is as small as
# its rounding error the step can change by up to ~lr (measured up to 1.9e-2 * lr over 112
# seeds, 1.7e-4 * lr on the test's data). Over a whole tensor that noise is >= 69 dB (same
# seeds, AVX2 and scalar kernels); unsynchronized gradients give ~0 dB.
ADAM_UPDATE_SQNR_DB = 40.0

# ---- test_dge.py ---------------------------------------------------------------------------
# DGE's float32 f' against its float64 evaluation, in ulp of the float32 result. On the CPU the
# power is `pow` (~1 ulp; measured <= 3 with the interval arithmetic). On CUDA it is
# exp2((1/k - 1)·log2|t|) (session 59, `dge._power`): exp2 magnifies the roundings of log2 and of
# the product by ln2·|y|, y <= log2(k·cap) below the cap. That form measured on the CPU (ATen,
# 20M points in [0, 6.5]): k = 3: 4.2, k = 5: 5.1, k = 10: 7.0 ulp.
DGE_FLOAT32_ULPS = {"cpu": 3.0, "cuda": 8.0}
# Compiled against eager f' on the CPU (inductor's C++ against ATen): float32 pow differs by an
# ulp or two between them. On CUDA the backend runs f' compiled in eager too: the same bits.
DGE_COMPILED_ULPS = 2.0

# ---- test_fsdp_quantized.py ----------------------------------------------------------------
# DGE recipes: max |g - g_ref| / max |g_ref| per tensor. The factor f'(w/s) is applied after the
# reduce-scatter, (a + b)·f, against a·f + b·f unsharded: fp32 rounding only (measured <= 7e-7).
DGE_GRAD_REL_TOL = 1e-5

# ---- test_convert_hf.py --------------------------------------------------------------------
# Lowest SQNR (dB) of the converted model's logits against the original's, per recipe. Measured
# on these tiny random models over three seeds: fp8 27.3-30.9 dB, fp4 14.4-18.3 dB.
HF_LOGITS_SQNR_MIN_DB = {
    "fp8-tensorwise": 22.0,  # E4M3, 3 mantissa bits: ~28 dB per layer, a few dB lost over depth
    "fp4": 11.0,  # E2M1, 1 mantissa bit: ~17 dB per layer with row scales and OCC
}

# Above this the model was not quantized at all (bf16 rounding alone gives ~50 dB; fp32 is exact).
HF_LOGITS_SQNR_MAX_DB = 45.0

# ---- test_convert.py -----------------------------------------------------------------------
# The tiny Llama trained 40 steps under fp4, then each converted layer's output against its
# float64 x·wᵀ under fp4 and under fp4-direct (same weights, same inputs): OCC ahead in every
# layer (measured 14 of 14, by 0.08-5.5 dB; the two layers with outlier inputs by ~5 dB) and by
# this much on average (measured 1.06 dB: the weights' E2M1 error, the same in both, holds y
# near 20 dB).
TINY_OCC_LAYERS_IMPROVED = 1.0
TINY_OCC_MEAN_GAIN_DB = 0.5

# ---- test_diagnostics.py -------------------------------------------------------------------
# The diagnostic rounds to 0.001 dB; the test's independent computation is float-for-float the
# same arithmetic, so only that rounding (<= 5e-4 dB) separates them (unrounded: < 1e-14 dB
# apart with AVX2 and with scalar kernels).
DIAGNOSTICS_SQNR_ABS_TOL_DB = 2e-3

# ---- inline bounds of single tests ------------------------------------------------------------
# Hopper against the emulation where the GEMMs accumulate differently (test_linear): fp32
# accumulation differences only.
HOPPER_VS_EMULATED_MIN_DB = 60.0
# fp32 sums of the same grid values against float64 (test_linear_state: fp8-delayed's steps):
# measured 120-136 dB.
FP32_SUMS_MIN_DB = 100.0
# nvfp4's two-level scale on data over 4 decades (test_quantize): E2M1 in 1x16 blocks, measured
# 19.9 dB.
NVFP4_TWO_LEVEL_MIN_DB = 15.0
# nvfp4 layer SQNR of grad_output (measure_layer_sqnr, test_microblock_linear): E2M1 with 1x16
# blocks, ~20 dB on Gaussian-like operands; above 30 dB it was not quantized.
NVFP4_GRAD_OUTPUT_DB = (15.0, 30.0)
# OCC (test_occ): y with E4M3 compensation within this of the exact fp32 compensation (the
# issue's 0.5 dB), dw through the E4M3 fold within 3.5 dB of fp32 (measured 1.3-2.5 dB behind)
# and at least 10 dB above no compensation (measured +18-20 dB).
OCC_Y_VS_FP32_DB = 0.5
OCC_DW_VS_FP32_DB = 3.5
OCC_DW_OVER_NONE_DB = 10.0
# `OCCConfig.one_gemm` (test_occ): y through the one GEMM against the separate E4M3 GEMM. The
# remainder is rounded on x_q's scale over a per-row factor instead of its own absmax scale:
# measured at most 0.06 dB lower over eight inputs (K = 512 to 2048), 0.23 dB with powers of two
# alone (session 65).
OCC_ONE_GEMM_VS_SEPARATE_DB = 0.1
