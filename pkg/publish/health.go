package publish

import (
	"encoding/json"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/cluster-inventory-api/apis/v1alpha1"
)

// healthCondition returns the ControlPlaneHealthy condition to keep on cp,
// or nil when the publisher keeps none there, and whether an apply must
// drop the one it owns. The caller has waited out the disconnect grace
// when live is 0.
//
// The publisher keeps it only with Config.ControlPlaneHealthy, and only
// where no other field manager owns it: a cluster manager that writes it
// knows the control plane better than an agent that reads /readyz, and
// two writers of one condition would flap it.
func (p *Publisher) healthCondition(cp *v1alpha1.ClusterProfile, live int, key types.NamespacedName) (want *metav1.Condition, drop bool) {
	others, ours := conditionManagers(cp, HealthConditionType, p.cfg.FieldManager)
	if !p.cfg.ControlPlaneHealthy || others {
		return nil, ours
	}
	c := metav1.Condition{Type: HealthConditionType}
	r := p.cfg.Source.SpokeReadiness(key)
	switch {
	case live == 0:
		c.Status, c.Reason = metav1.ConditionFalse, ReasonNoAgentConnected
		c.Message = "No agent of this cluster is connected to credbroker, so nothing reports its control plane."
	case r.Ready > 0:
		c.Status, c.Reason = metav1.ConditionTrue, ReasonSpokeReady
		c.Message = "An agent of this cluster reports that the spoke API server's /readyz answers ok."
	case r.NotReady > 0:
		c.Status, c.Reason = metav1.ConditionFalse, ReasonSpokeNotReady
		c.Message = "The agents of this cluster report that the spoke API server is not ready: " + r.Message
	default:
		c.Status, c.Reason = metav1.ConditionUnknown, ReasonNotReported
		c.Message = "The agents of this cluster report no spoke health: they predate the reports, " +
			"or run with --spoke-health-interval=0."
	}
	return &c, false
}

// conditionManagers reports whether a field manager other than manager
// owns cp's condition of type t, and whether manager does, as server-side
// apply records it in managedFields.
func conditionManagers(cp *v1alpha1.ClusterProfile, t, manager string) (others, ours bool) {
	key, _ := json.Marshal(map[string]string{"type": t})
	for _, mf := range cp.ManagedFields {
		if mf.FieldsV1 == nil || !ownsListEntry(mf.FieldsV1.Raw, "f:status", "f:conditions", "k:"+string(key)) {
			continue
		}
		if mf.Manager == manager && mf.Operation == metav1.ManagedFieldsOperationApply {
			ours = true
		} else {
			others = true
		}
	}
	return others, ours
}

// ownsListEntry reports whether a managedFields fieldsV1 set holds the
// path.
func ownsListEntry(raw []byte, path ...string) bool {
	for _, p := range path {
		var set map[string]json.RawMessage
		if json.Unmarshal(raw, &set) != nil {
			return false
		}
		var ok bool
		if raw, ok = set[p]; !ok {
			return false
		}
	}
	return true
}
