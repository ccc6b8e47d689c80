"""First tokens beside the batch, raced against it: interludes, the prefill process."""
