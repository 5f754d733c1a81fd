"""The trainer: consumes batches from the buffer, takes optimizer steps, pushes new weights."""
