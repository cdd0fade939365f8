"""CPU speed, behind the interfaces it serves. Nothing here changes what is computed, only how fast and in
how much memory on CPU; a GPU run never enters it, and the generic code reads without it.

* `products`: float32 products through oneDNN on non-Intel x86 CPUs (replaces `torch.mm` / `nn.Linear`).
* `lean`: RMSNorm and SwiGLU autograd functions that keep less for the backward (replace the modules).
* `document_attention`: padding-free attention over packed documents (an sdpa attention function).
* `few_rows` + `decode_kernels.c`, `decode`: the few-rows product kernel and the lean one-token decoding
  step (replace the model's forward in the sampler: `rollout.cpu_backend.CPUDecoder`).
* `replay`: the sampler's recorded linear outputs taken by the training forward (forward hooks).
* `memory`: allocator and file-backed-weight habits (the trainer's set-up).
* `threads`: the thread count from the process's CPU share and a short OpenMP spin (`import posttrain`).

accel imports nothing of posttrain but `core` and `cache`; the sampler, forward and trainers reach it.
"""
