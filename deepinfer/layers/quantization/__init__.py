"""Weights in a narrower format than the activations, each with a dequantizing reference path.

    fp8.py   FP8 e4m3 codes with float32 scales, per output channel (`--quantization fp8`) or
             per 128 x 128 block (DeepSeek-V4's checkpoints); their products as scaled FP8
             GEMMs where the device has one, else on the dequantized weight

The layers that hold such weights are the ordinary ones (layers/linear.py's `Linear`): a
quantized `Linear` keeps only its codes and scales, and `Linear.matmul` multiplies by them.
"""
