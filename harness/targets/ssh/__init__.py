"""SSH hosts: the paramiko transport, the backend, and container nodes on hosts."""
