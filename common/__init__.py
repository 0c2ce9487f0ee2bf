"""Helpers every layer uses: command-line parsing with one-line errors, and files written atomically and durably."""
