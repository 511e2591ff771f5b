"""Test-wide settings."""
import torch

# Test models are tiny: one intra-op thread avoids thread hand-off costs that dwarf the math
# (and the spin-waits that slow everything when other processes share the cores).
torch.set_num_threads(1)
