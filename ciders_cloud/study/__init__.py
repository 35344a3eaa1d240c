"""The quality study: ``simulate`` a federation in one process and ``report`` on it.

``simulate`` builds the study, ``round_loop`` runs its rounds, ``staging`` builds it beside ``--out``;
``partition`` splits the data over clients, ``diagnostics`` and ``evaluation`` score each round,
``report`` draws the plots. Its folder's layout: :class:`ciders_cloud.run.folder.StudyFolder`.
"""
