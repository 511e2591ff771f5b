"""latentserve's own CPU kernels (C, built on first use) and what the CPU offers them."""
