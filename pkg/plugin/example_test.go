package plugin_test

import (
	"fmt"

	"github.com/credbroker/credbroker/pkg/plugin"
)

func ExampleParseExecConfig() {
	// The "client.authentication.k8s.io/exec" extension of the ClusterProfile's
	// credbroker access provider, as ExecCredential spec.cluster.config.
	c, err := plugin.ParseExecConfig([]byte(`{"clusterProfile": {"namespace": "fleet", "name": "prod-eu-1"}}`))
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(c.ClusterProfile)

	_, err = plugin.ParseExecConfig([]byte(`{"namespace": "fleet", "name": "prod-eu-1"}`))
	fmt.Println(err)
	// Output:
	// fleet/prod-eu-1
	// exec config: unknown field "namespace"; unknown field "name"; want {"clusterProfile": {"namespace": "<namespace>", "name": "<name>"}}
}
