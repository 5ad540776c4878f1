"""Generation engines behind one interface (`base.Engine`): the embedded torch engine on CPU."""
