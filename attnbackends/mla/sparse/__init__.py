"""DeepSeek sparse attention (V3.2) on Triton: the lightning indexer, top-k selection and MLA over the selection
(the ``triton_mla_sparse`` backend)."""
