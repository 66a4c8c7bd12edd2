from dsaspec.cli import main

raise SystemExit(main())
