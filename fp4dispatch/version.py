"""The package version (its own module, so that code inside the package can read it without importing the
package root, which imports everything)."""

__version__ = "0.1.0"
