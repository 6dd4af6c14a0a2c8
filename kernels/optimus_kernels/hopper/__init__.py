"""The grouped GEMM's NVIDIA sm90+ kernels: what the triton backend runs on Hopper.

    grouped_mm_tma   persistent kernels on device-side tensor descriptors (TMA): forward, dx,
                     dW; any NVIDIA sm90+ GPU, or the Triton interpreter; with configs of
                     their own, Intel XPU's descriptor family too (2D block loads on PVC)
    grouped_mm_ws    a warp-specialized Gluon kernel (a TMA loader warp, two wgmma warpgroups)
                     for the forward and dx, with the SwiGLU fused into its epilogues; Hopper only

kernels/optimus_kernels/grouped_mm.py chooses among these and its portable pointer kernels (its FAMILIES), up to
the execution plan's choice; each is kept for its measured gain on the training step
(bench/README.md).
"""
