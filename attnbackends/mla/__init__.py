"""Multi-head latent attention (DeepSeek-V2/V3): latent cache, absorbed decode, chunked-context prefill.

Backends: ``reference_mla`` (pure torch, the oracle), ``triton_mla`` (our Triton decode kernel), ``flashinfer_mla``
(FlashInfer's MLA wrapper). The impl contract is :class:`attnbackends.interface.MLAAttentionImpl`.
"""
