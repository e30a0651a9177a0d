"""The command line and the process layout."""
