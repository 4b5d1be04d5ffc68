"""kvspec plugin for the mamba KV-cache family."""
