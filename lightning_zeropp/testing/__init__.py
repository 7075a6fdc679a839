"""Support for the tests of lightning-zeropp and of projects built on it: small models, spawned gloo ranks.

- :mod:`~lightning_zeropp.testing.models`: :class:`~lightning_zeropp.testing.models.TinyLM`, a tiny transformer
  language model with the shapes real ones have (tied embedding, odd sizes, norms beside matrices);
- :mod:`~lightning_zeropp.testing.distributed`: ``spawn`` (gloo ranks on CPU) and a quiet CPU ``lightning_trainer``;
- :mod:`~lightning_zeropp.testing.workers`: rank workers for parity tests and the single-process reference;
- :mod:`~lightning_zeropp.testing.kernels`: checks of the quantization kernels against their pure-torch twins.
"""
