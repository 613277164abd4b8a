"""The trainer pod's node agent: runs this node's ranks of each generation of the job."""
