"""kvspec plugin for the sliding_window KV-cache family."""
