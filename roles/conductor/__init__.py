"""The conductor: OpenAI-compatible front end and global scheduler."""
