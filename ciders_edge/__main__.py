from ciders_edge.cli import main

main()
