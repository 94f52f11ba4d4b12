"""What a checkpoint is: its spec and MoE config, weight loading, attention, and the torch reference."""
