from ciders_cloud.cli import main

main()
