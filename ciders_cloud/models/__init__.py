"""The cloud's models: the teacher and each learnable backbone (AdapEmu), their bootstrap, TAKD
(eq. 2 and 13), fidelity, and where their torch work runs."""
