"""Tensor parallelism over torch.distributed (gloo on CPU, NCCL on CUDA).

partition.py  which heads / MLP columns / vocabulary rows each rank owns (pure arithmetic)
comm.py       process groups and collectives (data group + gloo control group)
symm.py       torch symmetric-memory all-reduce for small messages (KVCAP_ALLREDUCE=symm)
layers.py     row-parallel linear, vocabulary-parallel embedding and LM head
launch.py     worker processes, watchdogs, clean shutdown (rank 0 side)
worker.py     `python -m kvcap.distributed.worker`: one rank > 0
protocol.py   rank 0 -> all ranks step messages, start-up agreement, calibration statistics
runner.py     rank 0's ModelRunner that broadcasts every step

See docs/tensor_parallel.md.
"""
