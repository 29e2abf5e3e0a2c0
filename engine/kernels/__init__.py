"""Triton kernels, one op per file, each beside its plain-torch reference and autograd.Function.

Import the op modules directly (`from engine.kernels.rmsnorm import rms_norm`). On CUDA the
Triton kernel runs; on a CPU the reference does, unless TRITON_INTERPRET=1 asks the tests to
run the kernel through Triton's interpreter.
"""
