"""The one rich console every command prints to."""

from rich.console import Console

console = Console()
