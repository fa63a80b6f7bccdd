"""KV copies between RAGCache's pools and vLLM's paged cache, behind one interface.

base.py            the interfaces (`CopyOps`, `PagedKV`, `TokenIndex`) and index helpers
torch_ops.py       `TorchCopyOps`: torch indexing (CPU, and CUDA without Triton)
triton_kernels.py  the Triton kernels (scatter/gather of token spans, whole-slot copies)
triton_ops.py      `TritonCopyOps`: the kernels behind `CopyOps` (CUDA)
reference.py       pure-torch references the kernels are tested against
factory.py         `copy_ops_for(device)`: the implementation for a device
"""
