"""What every offloading system shares: the budget rule and sink/recent window (`budget`), dense layers
(`dense`), retrievers (`retrieval`) and the host-to-device transfer engine (`transfer`)."""
