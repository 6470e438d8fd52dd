from ppoflow.cli import main

raise SystemExit(main())
