from dsaspec.commands.cli import main

raise SystemExit(main())
