"""Lowering of plans to device arrays, and the megakernel itself."""
