"""Lowerings of neural-network ops. They live in one module per family; importing this module
imports (and so registers) all of them:

* ``conv``      — convolution (1-3d, strided, dilated, grouped, transposed) and its backward;
* ``norm``      — layer/batch/group norm and their backward (see ``norm.batch_norm_update_stats``
  for the in-place running-stat update of ``aten.native_batch_norm``);
* ``pooling``   — max/avg/adaptive pooling and their backward, im2col/col2im;
* ``resize``    — upsampling (nearest, linear) and reflection/replication padding, with backward;
* ``loss``      — nll_loss (one-hot, no gather), mse, bce (with logits), smooth L1, Huber, soft margin;
* ``attention`` — the fused CPU scaled-dot-product attention op and its backward.

Example::

    import shardtensor.ops.nn
    from shardtensor.ops.norm import batch_norm_update_stats
"""
from shardtensor.ops import attention, conv, loss, norm, pooling, resize  # noqa: F401
from shardtensor.ops.norm import batch_norm_update_stats  # noqa: F401
