"""The compiled static-shape forwards of the target and the drafters (torch.compile, CUDA
graphs on a GPU), their shared buckets and the direct calls on a CPU."""
