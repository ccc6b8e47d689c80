"""Where resumable streams and jobs live: in the process, or in Redis for every replica."""
