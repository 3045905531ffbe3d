"""Plain Python + torch building blocks. Nothing in this package imports ray."""
