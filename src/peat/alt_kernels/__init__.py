"""Shipped alternative kernels: correct, but numerically different from PyTorch's golden ops.

Use them by dotted import in the config (``impl: peat.alt_kernels.im2col``). Each module
defines the kernel contract of ``peat.kernels`` for the ops it serves (a namespace per op
where it serves several):

    im2col         conv2d                   unfold + GEMM (forward, input grad via fold, weight grad)
    winograd       conv2d                   F(2x2,3x3) for 3x3, stride 1, dilation 1, ungrouped convs
                                            (forward and input grad); golden elsewhere and for weight grad
    blocked_gemm   linear                   K-blocked GEMM, 32-wide blocks accumulated in order
    splitk_gemm    linear                   split-K GEMM: 4 partial sums reduced at the end
    bf16_gemm      linear                   bf16 operands, fp32 accumulation (tensor-core style)
    fp16_gemm      linear                   fp16 operands, fp32 accumulation
    tf32           linear, conv2d           operands rounded to TF32 (10 mantissa bits), fp32 accumulation
    onepass_norm   batch_norm, layer_norm   variance as E[x^2] - E[x]^2 in one pass
    welford_norm   batch_norm, layer_norm   Welford / Chan running mean and M2
    rms_norm       rms_norm                 mean square in float64 rounded once, weight folded into the
                                            scale, textbook gradients
    compiled       all five                 the golden op compiled by torch.compile (Inductor); eager
                                            golden with a warning where compilation is unavailable
"""
