"""Reinforcement learning with a running engine: weight updates pushed into it (from disk, from tensors
in shared memory, by a torch.distributed broadcast from the trainer), and the trainer-side
forward that agrees with the engine's logprobs.

``updates``: ``WeightUpdater`` (check, then commit between steps) and the weight version;
``shm``: named tensors shared through a memory-mapped file (the HTTP tensor path);
``distributed``: the weights-update process group (engine and trainer sides);
``scoring``: log-probabilities of given tokens with the engine's own forward (no grad: a reference policy);
``kernel_autograd``: autograd functions whose forward is the engine's kernel, their backward written out;
``policy``: the trainer's model on them (``KernelPolicy``), whose logprobs are the rollout's bit for bit.
"""
