"""worker/: the per-GPU side behind an Executor (model runner, input batch, CUDA graphs, memory sizing)."""
